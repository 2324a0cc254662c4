import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "docs", "examples")
sys.path.insert(0, EXAMPLES)  # make_examples: the labelled example histories
