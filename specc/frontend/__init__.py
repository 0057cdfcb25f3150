"""Front end: YAML with locations -> interpolated, validated spec model."""
