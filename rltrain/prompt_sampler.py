"""Which prompts each step draws: shuffled passes over the training prompts, or difficulty pools
(``data.difficulty_sampling``), resumable exactly from a checkpoint's state (no ray, no deepspeed)."""

from __future__ import annotations

import heapq
import random

from rltrain.data import Prompt

POOLS = ("hard", "normal", "easy")


class PromptSampler:
    """Shuffled passes over the prompts; ``state()``/``load_state()`` make resumption exact.

    With ``difficulty`` (``data.difficulty_sampling``) each draw first picks a pool (hard, normal,
    easy, by each prompt's latest group mean reward: :meth:`observe`) with the pools' weights, then
    that pool's next prompt in the epoch's order; an epoch ends when no pool of positive weight has a
    prompt left in it. Where even a fresh epoch has none there (every prompt easy and
    ``easy_weight: 0``, say), draws take the epoch's next prompt of any pool, said once and counted
    (``data/pool_fallback_draws``). The pick's randomness is a function of (seed, epoch, draws this
    epoch), and the observed means are part of the state, so a resumed run draws what an
    uninterrupted one does. A draw costs O(log prompts): each pool keeps a heap of the places of its
    prompts in the epoch's order (a place stays in the heap it was pushed to when its prompt moves
    to another pool, and is passed over when it comes up)."""

    def __init__(self, prompts: list[Prompt], seed: int, difficulty=None):
        self.prompts, self.seed, self.difficulty = prompts, seed, difficulty
        self.epoch, self.position = 0, 0  # position: draws this epoch
        self.latest: dict[int, float] = {}  # prompt index -> its latest group mean reward
        self._drawn: set[int] = set()  # places of the epoch's order drawn (difficulty sampling)
        self._sizes = dict.fromkeys(POOLS, 0) | {"normal": len(prompts)}  # prompts per pool
        self.fallback_draws = 0
        self._order = self._shuffle(0)
        self._index_order()

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def _index_order(self) -> None:
        """Each pool's heap of the epoch's undrawn places (difficulty sampling)."""
        if self.difficulty is None:
            return
        self._place = {self.prompts[i].index: place for place, i in enumerate(self._order)}
        self._heaps = {pool: [] for pool in POOLS}
        for place, i in enumerate(self._order):  # (ascending: each list is a heap already)
            if place not in self._drawn:
                self._heaps[self.pool(self.prompts[i].index)].append(place)

    def _next_epoch(self) -> None:
        self.epoch, self.position, self._drawn = self.epoch + 1, 0, set()
        self._order = self._shuffle(self.epoch)
        self._index_order()

    def take(self, n: int) -> list[Prompt]:
        return [self._draw() for _ in range(n)]

    def _head(self, pool: str) -> int | None:
        """The pool's first undrawn place in the epoch's order, or None."""
        heap = self._heaps[pool]
        while heap and (
            heap[0] in self._drawn or self.pool(self.prompts[self._order[heap[0]]].index) != pool
        ):
            heapq.heappop(heap)  # drawn, or its prompt is in another pool now (and in that pool's heap)
        return heap[0] if heap else None

    def _draw(self) -> Prompt:
        if self.difficulty is None:
            if self.position == len(self._order):
                self._next_epoch()
            self.position += 1
            return self.prompts[self._order[self.position - 1]]
        weights = {"hard": self.difficulty.hard_weight, "normal": self.difficulty.normal_weight,
                   "easy": self.difficulty.easy_weight}  # fmt: skip
        first = {
            pool: place for pool in POOLS if weights[pool] > 0 and (place := self._head(pool)) is not None
        }
        if not first and any(weights[pool] > 0 and self._sizes[pool] for pool in POOLS):
            self._next_epoch()  # the positive pools' prompts are drawn out: a new pass
            first = {
                pool: place for pool in POOLS if weights[pool] > 0 and (place := self._head(pool)) is not None
            }
        if not first:  # no prompt in a pool of positive weight, even in a fresh pass
            if not self.fallback_draws:
                print("data.difficulty_sampling: no prompt is in a pool of positive weight; drawing from "
                      f"the others in the epoch's order ({self.pool_sizes()})", flush=True)  # fmt: skip
            self.fallback_draws += 1
            heads = [place for pool in POOLS if (place := self._head(pool)) is not None]
            if not heads:
                self._next_epoch()
                heads = [place for pool in POOLS if (place := self._head(pool)) is not None]
            place = min(heads)
        else:
            rng = random.Random((self.seed * 100_003 + self.epoch) * 1_000_003 + self.position)
            pools = [pool for pool in POOLS if pool in first]
            place = first[rng.choices(pools, [weights[pool] for pool in pools])[0]]
        self._drawn.add(place)
        self.position += 1
        return self.prompts[self._order[place]]

    def pool(self, index: int) -> str:
        """The pool of the prompt with this index: by its latest group mean reward (unseen: normal)."""
        return self._pool_of(self.latest.get(index))

    def _pool_of(self, mean: float | None) -> str:
        if self.difficulty is None or mean is None:
            return "normal"
        if mean <= self.difficulty.hard_at:
            return "hard"
        return "easy" if mean >= self.difficulty.easy_at else "normal"

    def observe(self, prompts: list[Prompt], means: list[float | None]) -> None:
        """Each prompt's latest group mean reward (None: no sample of its group counted)."""
        for prompt, mean in zip(prompts, means):
            if mean is None:
                continue
            before, after = self.pool(prompt.index), self._pool_of(float(mean))
            self.latest[prompt.index] = float(mean)
            if before != after:
                self._sizes[before] -= 1
                self._sizes[after] += 1
                place = self._place.get(prompt.index) if self.difficulty is not None else None
                if place is not None and place not in self._drawn:
                    heapq.heappush(self._heaps[after], place)

    def pool_sizes(self) -> dict[str, float]:
        """``data/pool_<name>``: how many prompts each pool holds now; ``data/pool_fallback_draws``:
        draws so far that no pool of positive weight could serve."""
        out = {f"data/pool_{pool}": float(n) for pool, n in self._sizes.items()}
        return out | {"data/pool_fallback_draws": float(self.fallback_draws)}

    def state(self) -> dict:
        state = {"epoch": self.epoch, "position": self.position}
        if self.difficulty is not None:  # (JSON: the prompts' indices as text)
            state |= {"drawn": sorted(self._drawn), "latest": {str(i): m for i, m in self.latest.items()},
                      "fallback_draws": self.fallback_draws}  # fmt: skip
        return state

    def load_state(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._drawn = set(state.get("drawn", []))
        self.latest = {int(i): m for i, m in state.get("latest", {}).items()}
        self.fallback_draws = state.get("fallback_draws", 0)
        self._sizes = dict.fromkeys(POOLS, 0)
        for prompt in self.prompts:
            self._sizes[self.pool(prompt.index)] += 1
        self._order = self._shuffle(self.epoch)
        self._index_order()
