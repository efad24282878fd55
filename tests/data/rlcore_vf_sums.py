"""An environment module as verifiers' ``load_environment(id)`` imports one (``rlcore-vf-sums`` ->
``rlcore_vf_sums``), for the tests: installed packages of environments look like this."""

from source_fixtures import arithmetic_env


def load_environment(n: int = 12, **kwargs):
    return arithmetic_env(n=n)
