"""Which prompts each step draws: shuffled passes over the training prompts, or difficulty pools
(``data.difficulty_sampling``), resumable exactly from a checkpoint's state (no ray, no deepspeed)."""

from __future__ import annotations

import heapq
import random

from rltrain.data import Prompt

POOLS = ("hard", "normal", "easy")


MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: 64 well-mixed bits of ``x`` (the same on every machine and Python)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class Permutation:
    """A pseudo-random permutation of ``range(n)`` fixed by ``seed``, evaluated at one point (either
    way) without a list of ``n``: a four-round Feistel network over the next even power of two,
    walked until it lands in range (expected under two steps)."""

    def __init__(self, n: int, seed: int):
        bits = max(2, (max(n, 2) - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [_mix(seed * 4 + r) for r in range(4)]

    def _forward(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def _backward(self, y: int) -> int:
        left, right = y >> self.half, y & self.mask
        for key in reversed(self.keys):
            left, right = right ^ (_mix(left ^ key) & self.mask), left
        return (left << self.half) | right

    def __call__(self, x: int) -> int:
        y = self._forward(x)
        while y >= self.n:
            y = self._forward(y)
        return y

    def inverse(self, y: int) -> int:
        x = self._backward(y)
        while x >= self.n:
            x = self._backward(x)
        return x


class PromptSampler:
    """Shuffled passes over the prompts; ``state()``/``load_state()`` make resumption exact.

    With ``difficulty`` (``data.difficulty_sampling``) each draw first picks a pool (hard, normal,
    easy, by each prompt's latest group mean reward: :meth:`observe`) with the pools' weights, then
    that pool's next prompt in the epoch's order; an epoch ends when no pool of positive weight has a
    prompt left in it. Where even a fresh epoch has none there (every prompt easy and
    ``easy_weight: 0``, say), draws take the epoch's next prompt of any pool, said once and counted
    (``data/pool_fallback_draws``). The pick's randomness is a function of (seed, epoch, draws this
    epoch), and the observed means are part of the state, so a resumed run draws what an
    uninterrupted one does.

    A draw costs O(log prompts), and an epoch's start costs the size of the pools it draws from, not
    the number of prompts (a pool of a few prompts of positive weight ends an epoch every few draws):
    the epoch's order is a :class:`Permutation` evaluated where asked, each pool keeps the prompts
    it holds, and a pool's heap of their places in the epoch's order is built when the epoch first
    draws from it (a place stays in the heap it was pushed to when its prompt moves to another pool,
    and is passed over when it comes up)."""

    def __init__(self, prompts: list[Prompt], seed: int, difficulty=None):
        self.prompts, self.seed, self.difficulty = prompts, seed, difficulty
        self.epoch, self.position = 0, 0  # position: draws this epoch
        self.latest: dict[int, float] = {}  # prompt index -> its latest group mean reward
        self._drawn: set[int] = set()  # places of the epoch's order drawn (difficulty sampling)
        self.fallback_draws = 0
        if difficulty is None:
            self._order = self._shuffle(0)
        else:
            self._at = {p.index: i for i, p in enumerate(prompts)}  # a prompt's index -> its position
            self._members = {pool: set() for pool in POOLS} | {"normal": set(range(len(prompts)))}
            self._start_epoch(0)

    @property
    def _sizes(self) -> dict[str, int]:
        if self.difficulty is None:
            return dict.fromkeys(POOLS, 0) | {"normal": len(self.prompts)}
        return {pool: len(members) for pool, members in self._members.items()}

    def _shuffle(self, epoch: int) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed * 100_003 + epoch).shuffle(order)
        return order

    def _start_epoch(self, epoch: int) -> None:
        """The epoch's order (difficulty sampling): no pool's heap built yet."""
        self.epoch, self._permutation = epoch, Permutation(len(self.prompts), self.seed * 100_003 + epoch)
        self._heaps: dict[str, list[int]] = {}

    def _next_epoch(self) -> None:
        self.position, self._drawn = 0, set()
        if self.difficulty is None:
            self.epoch += 1
            self._order = self._shuffle(self.epoch)
        else:
            self._start_epoch(self.epoch + 1)

    def take(self, n: int) -> list[Prompt]:
        return [self._draw() for _ in range(n)]

    def _heap(self, pool: str) -> list[int]:
        """The pool's undrawn places in the epoch's order, built at the epoch's first look."""
        if pool not in self._heaps:
            heap = [place for i in self._members[pool] if (place := self._permutation(i)) not in self._drawn]
            heapq.heapify(heap)
            self._heaps[pool] = heap
        return self._heaps[pool]

    def _head(self, pool: str) -> int | None:
        """The pool's first undrawn place in the epoch's order, or None."""
        heap = self._heap(pool)
        while heap and (heap[0] in self._drawn or self.pool(self._prompt_at(heap[0]).index) != pool):
            heapq.heappop(heap)  # drawn, or its prompt is in another pool now (and in that pool's heap)
        return heap[0] if heap else None

    def _prompt_at(self, place: int) -> Prompt:
        return self.prompts[self._permutation.inverse(place)]

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
        return self._prompt_at(place)

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
            if (
                before != after
                and self.difficulty is not None
                and (i := self._at.get(prompt.index)) is not None
            ):
                self._members[before].discard(i)
                self._members[after].add(i)
                place = self._permutation(i)
                if after in self._heaps and place not in self._drawn:
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
        if self.difficulty is None:
            self._order = self._shuffle(self.epoch)
            return
        self._members = {pool: set() for pool in POOLS}
        for i, prompt in enumerate(self.prompts):
            self._members[self.pool(prompt.index)].add(i)
        self._start_epoch(self.epoch)
