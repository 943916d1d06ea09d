"""compiled_psg: per-sample gradients, and statistics of them, at the cost of one training step.

Trace the batched loss and its gradients as one joint ATen graph, rewrite every contraction over the batch into
its per-sample form with rules keyed by ATen op, fuse the requested reduction, compile with Inductor.
"""

import logging

from ._api import PerSampleFunction as PerSampleFunction
from ._api import per_sample as per_sample
from ._api import per_sample_grad as per_sample_grad
from ._compat import warn_outside_window as _warn_outside_window
from ._errors import BatchInputError as BatchInputError
from ._errors import CaptureError as CaptureError
from ._errors import CompileError as CompileError
from ._errors import DPConfigError as DPConfigError
from ._errors import InternalError as InternalError
from ._errors import PerSampleError as PerSampleError
from ._errors import SampleMixingError as SampleMixingError
from ._errors import UnsupportedError as UnsupportedError
from ._explain import explain as explain
from ._heap import retain_freed_memory as retain_freed_memory
from ._inspect.report import Report as Report
from ._reduce.reductions import Reduction as Reduction
from ._reduce.reductions import clip_sum as clip_sum
from ._reduce.reductions import custom as custom
from ._reduce.reductions import gram as gram
from ._reduce.reductions import norms as norms
from ._reduce.reductions import sum_squares as sum_squares
from ._reduce.reductions import variance as variance
from ._rewrite.registry import register_rule as register_rule
from ._rewrite.table import supported_ops as supported_ops
from ._train.accounting import Accountant as Accountant
from ._train.accounting import calibrate_noise as calibrate_noise
from ._train.api import compile_step as compile_step
from ._train.config import DPConfig as DPConfig
from ._train.private import PrivateTraining as PrivateTraining
from ._train.private import make_private as make_private
from ._train.sampling import poisson_loader as poisson_loader
from ._train.schedulers import ExponentialNoise as ExponentialNoise
from ._train.schedulers import LambdaNoise as LambdaNoise
from ._train.schedulers import NoiseScheduler as NoiseScheduler
from ._train.schedulers import StepNoise as StepNoise

__version__ = "0.1.0"

logging.getLogger("compiled_psg").addHandler(logging.NullHandler())
_warn_outside_window()
