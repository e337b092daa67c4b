"""TensorBoard monitoring of distributed runs (Lightning callbacks).

- :class:`ThroughputMonitor`: tokens/s, samples/s (global, per device), model TFLOP/s and MFU;
- :class:`MemoryMonitor`: peak memory of every rank;
- :class:`CommunicationMonitor`: bytes and collectives per mesh dimension per step;
- :class:`PipelineBubbleMonitor`: the measured pipeline bubble of each step;
- :class:`GradientNormMonitor`: the global gradient norm;
- :class:`StragglerMonitor`: the rank the others wait for, every N steps;
- :class:`LayoutSummary`: which rank holds which mesh coordinates;
- :class:`ParallelMonitor`: all of the above, each switchable (on by default in the ``lightning-par`` command);
- :class:`ParallelProgressBar`: the layout and throughput in the progress bar;
- :class:`HuggingFaceExport`: the trained model saved as a Hugging Face directory when training ends;
- :class:`StepRecord`: batches, losses, gradient norms and weights of every step (``lightning-par verify``).

Expert load and dropped tokens are logged by the mixture-of-experts model itself (``moe/*``).
"""

from lightning_par.callbacks.communication import CommunicationMonitor
from lightning_par.callbacks.gradient_norm import GradientNormMonitor
from lightning_par.callbacks.hf_export import HuggingFaceExport
from lightning_par.callbacks.layout import LayoutSummary
from lightning_par.callbacks.memory import MemoryMonitor
from lightning_par.callbacks.monitor import ParallelMonitor
from lightning_par.callbacks.pipeline import PipelineBubbleMonitor
from lightning_par.callbacks.progress import ParallelProgressBar
from lightning_par.callbacks.step_record import StepRecord
from lightning_par.callbacks.stragglers import StragglerMonitor
from lightning_par.callbacks.throughput import ThroughputMonitor

__all__ = [
    "CommunicationMonitor",
    "GradientNormMonitor",
    "HuggingFaceExport",
    "LayoutSummary",
    "MemoryMonitor",
    "ParallelMonitor",
    "ParallelProgressBar",
    "PipelineBubbleMonitor",
    "StepRecord",
    "StragglerMonitor",
    "ThroughputMonitor",
]
