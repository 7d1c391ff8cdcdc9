import os
import sys

# tests/ holds helper modules (f64_math) imported by name.
sys.path.insert(0, os.path.dirname(__file__))
