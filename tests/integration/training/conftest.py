"""The torch tier runs torch on one thread: its models and probes are tiny, so a second intra-op
thread saves little time and spins between operations, taking a core from the rest of the run
(on a 2-core machine it costs 40% more CPU for the same tests)."""
try:
    import torch
except ImportError:  # the tests of this folder skip themselves
    torch = None

if torch is not None:
    torch.set_num_threads(1)
