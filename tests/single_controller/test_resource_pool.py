"""RayResourcePool in a shared cluster: pools of the same name prefix must not collide."""

from rlcore.single_controller import RayResourcePool


def test_two_pools_of_the_same_prefix_come_up_in_one_cluster(ray_cluster):
    """Placement-group names are unique per pool: Ray refuses a second group under an existing name."""
    first = RayResourcePool([1], num_cpus_per_process=0.25, ready_timeout_s=60)
    second = RayResourcePool([1], num_cpus_per_process=0.25, ready_timeout_s=60)
    try:
        assert len(first.placement_groups()) == len(second.placement_groups()) == 1
        assert first.pg_name_prefix != second.pg_name_prefix
    finally:
        first.shutdown()
        second.shutdown()
