"""The Plan: the one artifact everything downstream reads (text for people and diff, JSON for tools)."""

from .build import build_plan
from .render import plan_json, plan_text

__all__ = ["build_plan", "plan_json", "plan_text"]
