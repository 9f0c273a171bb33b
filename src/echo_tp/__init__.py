"""echo-tp: error-compensated 4-bit tensor-parallel all-reduce (the Echo paper, SPEC.md)."""
from .communicator import EchoCommunicator, SimulatedCommunicator
from .config import EchoConfig, QuantSpec

__version__ = "0.1.0"
__all__ = ["EchoCommunicator", "SimulatedCommunicator", "EchoConfig", "QuantSpec"]
