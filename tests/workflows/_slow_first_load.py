"""A module whose import takes 3 s, in 10 ms steps, as a slow disk under a large package would make
it: `tests.workflows._cold_worker` imports it in its model's first load. An exception raised into
the importing thread lands inside this import, which Python then forgets (the next load imports it
again, which the cold worker notes)."""

import time

for _ in range(300):
    time.sleep(0.01)
