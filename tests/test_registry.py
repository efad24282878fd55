import pytest

from rlcore.registry import Registry


def test_register_get_and_errors():
    reg = Registry("widget")

    @reg.register("a")
    def a():
        return 1

    assert reg.get("a") is a and "a" in reg and reg.names() == ["a"]
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        reg.register("a")(a)
    assert reg.get("rlcore.algos.preference:dpo_policy_loss").__name__ == "dpo_policy_loss"
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        reg.get("rlcore.registry:nope")
    with pytest.raises(ValueError, match=r"unknown widget 'b'; known: \['a'\]"):
        reg.get("b")
    with pytest.raises(TypeError, match="must be callable"):
        reg.register("c")(3)
