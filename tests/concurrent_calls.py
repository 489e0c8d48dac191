"""Many threads calling one kernel at once must get the bits a lone call gets."""

import threading
from typing import Callable, Sequence

import numpy as np


def differing_calls(compute: Callable[[np.ndarray], np.ndarray], xs: Sequence[np.ndarray], rounds: int = 20) -> list[int]:
    """Indices of `xs` whose result differed from a lone call's when computed from one thread each, `rounds` times."""
    expected = [compute(x).tobytes() for x in xs]
    failures: list[int] = []

    def hammer(i: int) -> None:
        for _ in range(rounds):
            if compute(xs[i]).tobytes() != expected[i]:
                failures.append(i)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return failures
