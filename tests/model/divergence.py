"""Logits out of a running engine, and how far one set of logits is from another.

LogitsTap sits between an Engine and its ModelRunner. Each forward then produces logits for
every row of the batch, not only the rows the runner samples from: the hidden states do not
depend on which rows get logits, and the output projection is row-wise, so the rows the
runner gets are the ones it would have computed. Every row is kept by (request, position):
the logits at position p are the model's prediction of token p + 1."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agentserve.engine.engine import Engine
from agentserve.engine.request import RequestId
from agentserve.engine.scheduler import Batch
from agentserve.model.config import ModelConfig
from agentserve.model.runner import ModelRunner
from agentserve.model.transformer import ChunkLayout, DecodeGroup, PagedKV, Transformer


class LogitsTap:
    def __init__(self, engine: Engine) -> None:
        """Installs itself as the engine's runner and as that runner's model."""
        assert isinstance(engine.runner, ModelRunner)
        self.runner = engine.runner
        self.model: Transformer = self.runner.model
        self.config: ModelConfig = self.model.config
        self.logits: dict[tuple[RequestId, int], torch.Tensor] = {}  # [vocab] fp32 each
        self._rows: list[tuple[RequestId, int]] = []  # the current batch's rows, in order
        self.runner.model = self  # type: ignore[assignment]
        self.engine = engine
        engine.runner = self

    def uninstall(self) -> None:
        """Puts the engine's runner and model back; the logits kept so far are dropped."""
        self.runner.model = self.model
        self.engine.runner = self.runner
        self.logits.clear()

    def run(self, batch: Batch) -> dict[RequestId, int]:
        self._rows = [(c.request_id, c.start_position + i) for c in batch.chunks
                      for i in range(len(c.token_ids))]
        return self.runner.run(batch)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, write_slots: torch.Tensor,
                chunks: list[ChunkLayout], kv: PagedKV, logit_rows: torch.Tensor,
                decode: DecodeGroup | None = None) -> torch.Tensor:
        every = self.model.forward(token_ids, positions, write_slots, chunks, kv,
                                   torch.arange(len(token_ids)), decode)
        assert len(self._rows) == len(every)
        self.logits.update(zip(self._rows, every))
        return every[logit_rows]

    def of(self, request_id: RequestId) -> tuple[list[int], torch.Tensor]:
        """The positions this request computed (a prefix-cache hit computes none of the cached
        ones), and their logits: [len(positions), vocab]."""
        positions = sorted(p for r, p in self.logits if r == request_id)
        return positions, torch.stack([self.logits[(request_id, p)] for p in positions])


@dataclass(frozen=True, slots=True)
class Divergence:
    """Of logits x from reference logits, summarized over n positions."""

    n: int
    mean_kl: float  # mean over positions of KL(softmax(ref) || softmax(x)), nats
    mean_max_abs: float  # mean over positions of max over the vocabulary of |x - ref|
    max_abs: float  # the largest |x - ref| anywhere
    top1: float  # fraction of positions whose argmax is the reference's

    def __str__(self) -> str:
        return (f"n={self.n} KL {self.mean_kl:.3e} max|dlogit| mean {self.mean_max_abs:.3f} "
                f"max {self.max_abs:.3f} top-1 {self.top1:.4f}")


@dataclass(frozen=True, slots=True)
class PerPosition:
    """Of logits x from reference logits, at each position: [positions] each."""

    kl: torch.Tensor
    max_abs: torch.Tensor
    agree: torch.Tensor  # bool: same argmax

    @staticmethod
    def of(ref: torch.Tensor, x: torch.Tensor) -> PerPosition:
        """ref, x: [positions, vocab]."""
        ref, x = ref.double(), x.double()
        log_p, log_q = torch.log_softmax(ref, -1), torch.log_softmax(x, -1)
        return PerPosition(kl=(log_p.exp() * (log_p - log_q)).sum(-1), max_abs=(x - ref).abs().amax(-1),
                           agree=x.argmax(-1) == ref.argmax(-1))

    @staticmethod
    def cat(parts: list[PerPosition]) -> PerPosition:
        return PerPosition(*(torch.cat([getattr(p, f) for p in parts]) for f in ("kl", "max_abs", "agree")))

    def summary(self, rows: torch.Tensor | None = None) -> Divergence:
        """Over the positions rows selects (a bool mask), or all."""
        kl, max_abs, agree = (t if rows is None else t[rows] for t in (self.kl, self.max_abs, self.agree))
        return Divergence(n=len(kl), mean_kl=float(kl.mean()), mean_max_abs=float(max_abs.mean()),
                          max_abs=float(max_abs.max()), top1=float(agree.double().mean()))
