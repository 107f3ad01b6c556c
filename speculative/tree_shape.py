"""Draft trees (docs/design.md §5.5): a spine of top-1 drafts with hedge leaves, its verify rows and the
accepted path.

Shapes: n verify rows (root plus nodes), C committed context positions.

A shape is a count per depth, e.g. `1,2,2`: depth d holds one spine node and `count - 1` hedge
leaves, the drafter's next-best tokens at that depth. Verify rows: row 0 the root (the last
committed token), rows 1..L the spine in depth order, then the hedges in list order. A hedge's
parent is the spine row one depth up; hedges have no children. Every row sits at the absolute
position `start + depth` and sees the committed context plus its ancestors.
"""
from __future__ import annotations

from dataclasses import dataclass


from runtime.executor.attention import NO_PARENT

MAX_COUNT = 4
MAX_NODES = 7

VerifyRow = tuple[int, int, int]      # (token, depth, parent_row)


@dataclass(frozen=True, slots=True)
class TreeShape:
    counts: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.counts:
            raise ValueError("a tree shape needs at least one depth, e.g. 1,2,2")
        bad = next((c for c in self.counts if not isinstance(c, int) or not 1 <= c <= MAX_COUNT), None)
        if bad is not None:
            raise ValueError(f"tree shape {self.text}: count {bad!r} is outside 1..={MAX_COUNT}")
        if sum(self.counts) > MAX_NODES:
            raise ValueError(f"tree shape {self.text} has {sum(self.counts)} nodes, at most {MAX_NODES} are allowed")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """`"1, 2,2"` -> TreeShape((1, 2, 2)); raises ValueError naming the bad part."""
        parts = [p.strip() for p in str(text).split(",")]
        if not all(p.isdigit() for p in parts):
            raise ValueError(f"tree shape {text!r} is not a comma list of counts per depth (each 1..={MAX_COUNT}), "
                             "e.g. 1,2,2")
        return cls(tuple(int(p) for p in parts))

    @property
    def text(self) -> str:
        return ",".join(map(str, self.counts))

    @property
    def spine_len(self) -> int:
        return len(self.counts)

    @property
    def num_nodes(self) -> int:
        return sum(self.counts)

    @property
    def verify_width(self) -> int:
        return self.num_nodes + 1

    @property
    def is_chain(self) -> bool:
        return all(c == 1 for c in self.counts)

    @property
    def shape_id(self) -> int:
        """The counts as decimal digits (`1,2,2` -> 122): one number per shape."""
        return int("".join(map(str, self.counts)))

    def nodes_at(self, depth: int) -> int:
        """Nodes of the shape cut to its first `depth` depths (the draft rows of a verify)."""
        return sum(self.counts[:depth])

    def parents(self, depth: int) -> list[int]:
        """Parent row of each verify row of the shape cut to `depth` depths (the root's is -1)."""
        spine = [NO_PARENT] + list(range(depth))
        hedges = [d - 1 for d in range(1, depth + 1) for _ in range(self.counts[d - 1] - 1)]
        return spine + hedges


def verify_rows(root: int, spine: list[int], hedges: list[tuple[int, int]]) -> list[VerifyRow]:
    """The verify rows `(token, depth, parent_row)`: the root, the spine in depth order, then the
    hedges (`(depth, token)` pairs) in list order, each under the spine row one depth up."""
    rows: list[VerifyRow] = [(root, 0, NO_PARENT)]
    rows += [(tok, d, d - 1) for d, tok in enumerate(spine, 1)]
    for d, tok in hedges:
        if not 1 <= d <= len(spine):
            raise ValueError(f"hedge {tok} at depth {d}: the spine has depths 1..{len(spine)}")
        rows.append((tok, d, d - 1))
    return rows


def accepted_path(spine: list[int], hedges: list[tuple[int, int]], targets: list[int]) -> tuple[list[int], int]:
    """Walk depth 1..L from the root: the target's token after the current row is matched
    against the spine child first, then that depth's hedges in order; the first match is taken
    and taking a hedge ends the walk. Returns (the accepted rows, root excluded, in depth order;
    the bonus token: the target's token after the last accepted row, or after the root)."""
    rows = verify_rows(0, spine, hedges)
    if len(targets) != len(rows):
        raise ValueError(f"{len(rows)} verify rows need {len(rows)} target tokens, got {len(targets)}")
    path: list[int] = []
    current = 0
    for d in range(1, len(spine) + 1):
        want = targets[current]
        if spine[d - 1] == want:
            current = d
            path.append(d)
            continue
        hedge = next((r for r in range(len(spine) + 1, len(rows)) if rows[r][1] == d and rows[r][0] == want), None)
        if hedge is not None:
            path.append(hedge)
            current = hedge
        break
    return path, targets[current]
