"""What a vLLM worker process tells its group leader about itself.

vLLM mixes :class:`RankProbe` into every worker (its ``worker_extension_cls`` hook), so the leader
asks the ranks themselves through ``AsyncLLM.collective_rpc`` — one answer per rank, in rank order —
rather than looking for them in its process tree by title: full CI runs now and then found no rank
that way although the engine was serving.
"""

from __future__ import annotations

import os

RANK_PROBE = f"{__name__}.RankProbe"


class RankProbe:
    def flotilla_rank_process(self) -> tuple[int, str]:
        """This rank's process id and title (``VLLM::Worker_TP0``; ``VLLM::EngineCore`` for a single rank)."""
        import setproctitle

        return os.getpid(), setproctitle.getproctitle()
