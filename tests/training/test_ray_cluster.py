"""training/ray_cluster.py: the room check reads Ray's free resources, which lag the end of an
actor; CPUs of actors just killed count as free once Ray frees them, a real shortfall is one
line naming the settings."""

from __future__ import annotations

import pytest
import ray

from tests.helpers import ray_temp_dir
from training.ray_cluster import check_room


@ray.remote(num_cpus=1)
class _Holder:
    def ping(self) -> int:
        return 1


@pytest.fixture(scope="module")
def two_cpus():
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=ray_temp_dir(), logging_level="WARNING")
    yield
    ray.shutdown()


def test_the_cpus_of_actors_just_killed_are_room_for_the_next(two_cpus):
    for _ in range(3):  # Ray's free count right after ray.kill was 0 of 2 each time here
        holders = [_Holder.remote() for _ in range(2)]
        ray.get([holder.ping.remote() for holder in holders])
        for holder in holders:
            ray.kill(holder, no_restart=True)
        check_room([("trainer ranks", 2, 1.0, 0.0)], "train.rank_cpus")


def test_a_real_shortfall_is_one_line_naming_the_settings(two_cpus):
    with pytest.raises(ValueError, match=r"^2 engines x 1 \+ 1 trainer ranks x 1 CPUs = 3 CPUs, but the Ray cluster "
                                         r"has 2 free; lower generator\.engine_cpus \(fractions are fine\)"):
        check_room([("engines", 2, 1.0, 0.0), ("trainer ranks", 1, 1.0, 0.0)], "generator.engine_cpus", wait=0.3)
