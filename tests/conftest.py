import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

# Tests are small: one thread per worker keeps `pytest -n 2` from oversubscribing 2 cores.
torch.set_num_threads(1)
