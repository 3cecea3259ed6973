"""Training data: a synthetic token stream (default) or byte-level tokens of a local text file.

Batches are addressed by a global microbatch index: microbatch ``i`` is deterministic in (seed, i).
A step consumes dp·m of them — data-parallel rank r's microbatch j of the step starting at position P
is index P + r·m + j — so the data position (the next index) is one integer that a checkpoint holds,
and a resumed run, on the same or another topology, continues with exactly the microbatches an
uninterrupted run would read next.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import OptionError


@dataclass
class SyntheticStream:
    """Sequences from a fixed sparse Markov chain over the vocabulary: learnable, not trivial."""

    vocab_size: int
    seq_len: int
    batch_size: int
    seed: int = 0
    branching: int = 4

    def __post_init__(self) -> None:
        g = torch.Generator().manual_seed(self.seed)
        self.next_tokens = torch.randint(0, self.vocab_size, (self.vocab_size, self.branching), generator=g)

    def batch(self, index: int) -> torch.Tensor:
        """Microbatch ``index`` [batch_size, seq_len]."""
        g = torch.Generator().manual_seed(hash((self.seed, index)) & 0x7FFFFFFF)
        tok = torch.randint(0, self.vocab_size, (self.batch_size,), generator=g)
        seq = [tok]
        for _ in range(self.seq_len - 1):
            choice = torch.randint(0, self.branching, (self.batch_size,), generator=g)
            tok = self.next_tokens[tok, choice]
            seq.append(tok)
        return torch.stack(seq, dim=1)


def check_data_file(path: str, seq_len: int) -> None:
    """OptionError unless ``path`` is a readable file holding at least one sequence and its label."""
    p = Path(path)
    try:
        size = p.stat().st_size
        with open(p, "rb"):
            pass
    except OSError as e:
        raise OptionError(f"--data {path}: cannot read it ({e.strerror or e})") from None
    if not p.is_file():
        raise OptionError(f"--data {path}: not a regular file")
    if size < seq_len + 1:
        raise OptionError(f"--data {path}: {size} bytes is shorter than one sequence and its next-token label "
                          f"(--seq-len {seq_len} + 1)")


@dataclass
class ByteFileStream:
    """Byte-level tokens (vocab 256) of a local text file, in windows of seq_len."""

    path: str
    seq_len: int
    batch_size: int
    seed: int = 0

    def __post_init__(self) -> None:
        check_data_file(self.path, self.seq_len)
        data = Path(self.path).read_bytes()
        self.tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def batch(self, index: int) -> torch.Tensor:
        """Microbatch ``index`` [batch_size, seq_len]: windows at seeded random offsets."""
        g = torch.Generator().manual_seed(hash((self.seed, index)) & 0x7FFFFFFF)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len, (self.batch_size,), generator=g)
        return torch.stack([self.tokens[s: s + self.seq_len] for s in starts.tolist()])


def step_microbatches(stream, position: int, dp_rank: int, m: int) -> list[torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s m microbatches of the step that starts at ``position``."""
    return [stream.batch(position + dp_rank * m + j) for j in range(m)]
