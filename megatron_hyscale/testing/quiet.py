"""Known megatron-core warnings that tell a HyScale user nothing, and a context that hides them.

megatron-core 0.19.2 on a machine without Transformer Engine, Apex or CUDA (the demo, the CPU
test suite) warns thousands of times about its own deprecations and fallbacks: every linear
warns that its tp_group is None, every MLP that it was not given ffn_hidden_size, and so on.
`MEGATRON_WARNINGS` names each such warning exactly (message regex, category, module), and
`MEGATRON_LOG_MESSAGES` the two log records of the same kind; `quiet_megatron()` hides exactly
those inside a block (the demo runs in it). HyScale's own warnings (`ops.checks.warn_once`, the
layers' fallbacks) and anything else stay visible.

pytest cannot import this list: pyproject.toml's `[tool.pytest.ini_options] filterwarnings`
carries the same filters as strings, and tests/test_warnings_filter.py checks that the two
agree, that each filter still matches what megatron-core says, and that HyScale's warnings pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import warnings
from collections.abc import Iterator


@dataclasses.dataclass(frozen=True)
class KnownWarning:
    """One warning to hide: `message` and `module` are regexes matched at the start of the
    warning's text and of the name of the module it is attributed to (Python's rules)."""

    what: str  # what it is and why it is noise here
    message: str
    category: type[Warning]
    module: str

    def ini_line(self) -> str:
        """The same filter in pytest's `filterwarnings` syntax (`action:message:category:module`).

        The fields are separated by colons, so a colon in the message is written `\\x3a`."""
        if ":" in self.module:
            raise ValueError(f"module regex {self.module!r} contains a colon")
        message = self.message.replace(":", r"\x3a")
        return f"ignore:{message}:{self.category.__name__}:{self.module}"


MEGATRON_WARNINGS: tuple[KnownWarning, ...] = (
    KnownWarning("every megatron linear, norm and loss built without a tp_group argument "
                 "(megatron-core's own modules do not pass it yet)",
                 r"Warning: tp_group is None, using default tp group", DeprecationWarning,
                 r"megatron\.core\."),
    KnownWarning("every MLP megatron-core's own specs build without ffn_hidden_size",
                 r"MLP requires ffn_hidden_size, but it was not provided", DeprecationWarning,
                 r"megatron\.core\.transformer\."),
    KnownWarning("TransformerConfig's default cuda_graph_modules, on every config",
                 r"full scope is deprecated", UserWarning,
                 r"megatron\.core\.transformer\.transformer_config"),
    KnownWarning("TE spec provider asked for MoE experts where Transformer Engine is absent "
                 "(version 0.0.0); it falls back to local linears",
                 r"Only transformer-engine>=1\.7\.0 supports MoE experts", UserWarning,
                 r"megatron\.core\.extensions\.transformer_engine_spec_provider"),
    KnownWarning("import-time fallbacks to torch optimizers / multi-tensor kernels without "
                 "Transformer Engine and Apex (optional for HyScale)",
                 r"Transformer Engine and Apex are not installed\. Falling back", UserWarning,
                 r"megatron\."),
    KnownWarning("import-time fallback to torch norms without Apex",
                 r"Apex is not installed\. Falling back to Torch Norm", UserWarning,
                 r"megatron\.core\.models\."),
    KnownWarning("import-time fallback to the logging module without absl",
                 r"absl\.logging is not installed", UserWarning,
                 r"megatron\.core\.hyper_comm_grid"),
    KnownWarning("megatron-core's inference package importing its own moved names",
                 r"The following imports from `dynamic_context\.py` will be removed",
                 DeprecationWarning, r"megatron\.core\.inference\.contexts"),
    KnownWarning("megatron's rank lookup before torch.distributed is set up (the launchers' "
                 "dry runs build arguments in one process)",
                 r"Could not determine rank from torch\.distributed, RANK, or SLURM_PROCID",
                 UserWarning, r"megatron\.core\._rank_utils"),
    KnownWarning("advice for Transformer Engine users of selective core_attn recompute; "
                 "HyScale's CPU configs use local modules",
                 r"If you are using transformer_engine as the transformer implementation, the "
                 r"core_attn is from transformer_engine", UserWarning,
                 r"megatron\.core\.transformer\.transformer_config"),
    KnownWarning("torch's own use of script_method, reached by megatron-core's torch.compile "
                 "at import",
                 r"`torch\.jit\.script_method` is deprecated", DeprecationWarning,
                 r"torch\.jit\._script"),
    KnownWarning("megatron.training's argument parser (BooleanOptionalAction with type=bool, "
                 "the --rl-* flags), reached by the launchers' argument checks",
                 r".type. is deprecated as of Python 3\.12", DeprecationWarning, r"argparse"),
)

# (logger name, message regex): log records of the same kind.
MEGATRON_LOG_MESSAGES: tuple[tuple[str, str], ...] = (
    # GPTModel's constructor, once per model built (megatron-core steers users to HybridModel).
    ("megatron.core.models.gpt.gpt_model", r"GPTModel IS DEPRECATED"),
    # torch.utils.cpp_extension, imported by megatron-core, on a machine without CUDA.
    ("torch.utils.cpp_extension", r"No CUDA runtime is found"),
)


class _DropMessages(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.match(record.getMessage())


def add_warning_filters() -> None:
    """Ignore `MEGATRON_WARNINGS` (prepended to `warnings.filters`, so they win)."""
    for known in MEGATRON_WARNINGS:
        warnings.filterwarnings("ignore", message=known.message, category=known.category,
                                module=known.module)


@contextlib.contextmanager
def quiet_megatron() -> Iterator[None]:
    """Hide `MEGATRON_WARNINGS` and `MEGATRON_LOG_MESSAGES` inside the block, nothing else."""
    added: list[tuple[logging.Logger, logging.Filter]] = []
    with warnings.catch_warnings():
        add_warning_filters()
        try:
            for name, pattern in MEGATRON_LOG_MESSAGES:
                logger, log_filter = logging.getLogger(name), _DropMessages(pattern)
                logger.addFilter(log_filter)
                added.append((logger, log_filter))
            yield
        finally:
            for logger, log_filter in added:
                logger.removeFilter(log_filter)
