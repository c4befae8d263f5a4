import os
import sys

# The spawn helper lives beside the tests; spawned ranks inherit sys.path from the parent.
sys.path.insert(0, os.path.dirname(__file__))

WORLD_SIZES = [1, 2, 4]
