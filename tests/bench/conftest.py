import os
import sys

# bench_modules beside these tests, importable by name
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
