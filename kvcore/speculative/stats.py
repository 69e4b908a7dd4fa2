"""Speculation figures: how many drafts were made, verified and kept."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    max_draft: int
    rounds: int = 0  # target verify passes (one per round, all rows together)
    row_steps: int = 0  # (row, round) pairs
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens kept
    verified: int = 0  # real positions the target computed (each row: its drafts + 1)
    padded: int = 0  # padding positions of the verify passes
    emitted: int = 0  # tokens the rounds produced (kept drafts + the target's one), before stops
    replays: int = 0  # rows whose SSM state was restored and replayed
    hist: list[int] = field(default_factory=list)  # hist[a]: row steps with a drafts kept (>= 1 drafted)

    def __post_init__(self):
        self.hist = self.hist or [0] * (self.max_draft + 1)

    def record(self, drafted: list[int], accepted: list[int], width: int) -> None:
        """One round: per row, drafts proposed and kept; `width` = verify positions per row."""
        self.rounds += 1
        self.row_steps += len(drafted)
        self.drafted += sum(drafted)
        self.accepted += sum(accepted)
        self.verified += sum(drafted) + len(drafted)
        self.padded += width * len(drafted) - sum(drafted) - len(drafted)
        self.emitted += sum(accepted) + len(accepted)
        for d, a in zip(drafted, accepted):
            if d:
                self.hist[a] += 1

    def to_json(self) -> dict:
        steps_drafted = sum(self.hist)
        return {
            "num_draft_tokens": self.max_draft, "rounds": self.rounds, "row_steps": self.row_steps,
            "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
            "verified_tokens": self.verified, "padded_positions": self.padded,
            "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else None,
            "mean_accepted": round(self.accepted / steps_drafted, 3) if steps_drafted else None,
            "tokens_per_step": round(self.emitted / self.row_steps, 3) if self.row_steps else None,
            "accepted_histogram": list(self.hist), "ssm_replays": self.replays,
        }

