"""torch.compile through accelerate: the `TorchDynamoPlugin` the recipes use, and what it did."""

from __future__ import annotations

import logging

from accelerate.logging import get_logger
from accelerate.utils import TorchDynamoPlugin

logger = get_logger(__name__)


def dynamo_plugin(args) -> TorchDynamoPlugin | None:
    """accelerate's torch.compile settings for --torch_compile (None without it).

    - dynamic=True: one graph serves every padded sequence length and batch size. accelerate
      1.15's `accelerate launch` exports ACCELERATE_DYNAMO_USE_DYNAMIC=False (1.16 only with
      --dynamo_use_dynamic given), which the plugin would read: each new
      length would then recompile, up to dynamo's limit of 8, after which the model silently runs
      uncompiled (measured: 8 graphs and the limit hit within 8 MRPC steps; dynamic: 3 graphs).
      Static shapes over length buckets (padding to multiples of 32) were measured as the other
      bound, and lost (MiniLM, MRPC, 1 epoch, 2-core Xeon): 29 graphs against 10, each new bucket
      a compile of its own, and the extra padding: 311 s of training against 153 s, both with a
      cold compile cache (eager: 99 s). docs/results.md: "torch.compile on this CPU".
    - use_regional_compilation: the repeated encoder layer is compiled once and reused by every
      layer, not compiled 6-24 times: a shorter compile, the same kernels.
    """
    if not args.torch_compile:
        return None
    return TorchDynamoPlugin(
        backend=args.torch_compile_backend,
        mode=args.torch_compile_mode,
        dynamic=True,
        use_regional_compilation=True,
    )


class CompileMonitor:
    """What torch.compile did in this run: how many graphs dynamo compiled (its own counters), and
    whether it hit its recompile limit, after which it runs the function uncompiled without further
    notice. Dynamo's one warning goes to the `torch._dynamo` logger; this listens to it and says it
    again in the run's own log, when it happens."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.limit_warnings: list[str] = []
        if enabled:
            from torch._dynamo.utils import counters

            self._stats = counters["stats"]
            self._graphs_before = self._stats["unique_graphs"]
            self._handler = logging.Handler(logging.WARNING)
            self._handler.emit = self._record
            logging.getLogger("torch._dynamo").addHandler(self._handler)
            logger.info(
                "torch.compile: the fp16 range monitor (--activation_monitor_interval) is off, its hooks "
                "would recompile the model; --diagnose_overflow cannot be combined with --torch_compile."
            )

    def _record(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.limit_warnings.append(message.splitlines()[0])
            logger.warning(
                f"torch.compile hit dynamo's recompile limit: parts of the model now run uncompiled ({self.limit_warnings[-1]})."
            )

    def report(self) -> dict:
        """{"compiled_graphs", "recompile_limit_hit"} (empty without torch.compile); stops listening."""
        if not self.enabled:
            return {}
        logging.getLogger("torch._dynamo").removeHandler(self._handler)
        graphs = self._stats["unique_graphs"] - self._graphs_before
        return {"compiled_graphs": graphs, "recompile_limit_hit": bool(self.limit_warnings)}
