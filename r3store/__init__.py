"""r3store: a routing replay buffer for Mixture-of-Experts reinforcement learning."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("r3store")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"
