"""Memory handed back to the machine (rlcore.engines.host_memory), measured as the resident anonymous
memory of a fresh interpreter (its heap in a known state, no other test's threads allocating)."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, Linux's madvise")

MIB = 2**20

# 4096 tensors of 64 KiB (under glibc's mmap threshold: they live in the heap), all freed but the last,
# which keeps the free space from the heap's top where free() alone would give it back; then a 64 MiB
# tensor (mmapped) whose pages are released. Prints the anonymous resident memory at each point.
CHILD = """
import json, mmap, torch
from rlcore.engines.host_memory import release_pages, trim_heap

def anon():
    with open("/proc/self/smaps_rollup") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("Anonymous:"))

out = {"start": anon()}
blocks = [torch.ones(16384) for _ in range(4096)]
out["held"] = anon()
last = blocks[-1]
del blocks
out["freed"] = anon()
out["trimmed_ok"] = trim_heap()
out["trimmed"] = anon()
big = torch.ones(16 * 2**20)
out["big"] = anon()
out["released"] = release_pages(big)
out["after_release"] = anon()
page = mmap.PAGESIZE  # whole pages only are released: the tensor's partial first and last pages keep their data
start = (-big.data_ptr() % page) // 4
end = big.numel() - ((big.data_ptr() + big.numel() * 4) % page) // 4
out["zeros"] = bool((big[start:end] == 0).all())
out["edges_kept"] = bool((big[:start] == 1).all() and (big[end:] == 1).all())
big.fill_(2.0)
out["rewritten"] = anon()
out["twos"] = bool((big == 2).all())
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def readings():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_heap_stays_resident_until_trimmed(readings):
    r = readings
    assert r["held"] - r["start"] > 240 * MIB  # 256 MiB of small tensors, in the heap
    assert r["freed"] - r["start"] > 240 * MIB  # freed, but glibc keeps the pages: what a run saw between steps
    assert r["trimmed_ok"]
    assert r["freed"] - r["trimmed"] > 240 * MIB  # malloc_trim(0) hands them back


def test_released_pages_read_as_zeros_and_are_taken_again_when_written(readings):
    r = readings
    assert r["big"] - r["trimmed"] > 60 * MIB
    assert 64 * MIB - 8192 <= r["released"] <= 64 * MIB  # the tensor's whole pages
    assert r["big"] - r["after_release"] > 60 * MIB
    assert r["zeros"] and r["edges_kept"]  # its whole pages' contents gone, the partial pages' kept
    assert r["rewritten"] - r["after_release"] > 60 * MIB and r["twos"]


# A 100 MiB tensor made and freed five times (over glibc's mmap threshold, which is 32 MiB at most), then
# the minor page faults each of the last four took: with keep_large_blocks, the heap keeps the freed block
# and the next one reuses its pages; without, each is mapped afresh and every page faulted in again.
REUSE_CHILD = """
import json, resource, sys, torch
from rlcore.engines.host_memory import keep_large_blocks

took = keep_large_blocks() if sys.argv[1] == "keep" else None
faults = []
for _ in range(5):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = torch.ones(25 * 2**20)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    del block
print(json.dumps({"took": took, "faults": faults[1:]}))
"""


@pytest.mark.parametrize("mode", ["keep", "default"])
def test_keep_large_blocks_reuses_a_freed_large_block_without_faulting_it_in_again(mode):
    done = subprocess.run([sys.executable, "-c", REUSE_CHILD, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    r = json.loads(done.stdout.strip().splitlines()[-1])
    pages = 100 * MIB // 4096
    if mode == "keep":
        assert r["took"] is True
        # the same heap pages again (once, a small block freed-and-taken between two can push the next
        # one up past the heap's top: those pages are new; [0, 25600, 0, 0] was seen)
        assert sum(r["faults"]) < 1.5 * pages and sorted(r["faults"])[1] < pages // 20, r
    else:
        assert min(r["faults"]) > pages * 0.9, r  # every page of every block faulted in


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_backward_trims_once_per_layer_and_leaves_the_gradients_alone(monkeypatch, checkpointed):
    """``trim_between_layers``: one trim after each hooked layer's forward and one as the backward reaches
    it (a checkpointed layer's recompute adds none: torch stops it once the saved tensors are back,
    before the layer's hooks), none for a forward under no_grad; the gradients are those of the same
    model without hooks, bit for bit."""
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    from rlcore.engines import host_memory

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Sequential(nn.Linear(16, 16), nn.Tanh())

        def forward(self, x):
            return checkpoint(self.inner, x, use_reentrant=False) if checkpointed else self.inner(x)

    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(4)])
    x = torch.randn(8, 16)
    model(x).square().sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    trims = []
    monkeypatch.setattr(host_memory, "trim_heap", lambda: trims.append(1) or True)
    handles = host_memory.trim_between_layers([block.inner for block in model], every=1)
    assert len(handles) == 4
    with torch.no_grad():
        model(x)
    assert trims == []
    loss = model(x).square().sum()
    assert len(trims) == 4  # after each layer's forward
    loss.backward()
    assert len(trims) == 4 + 4  # as the backward reaches each layer (a recompute stops before its hooks)
    for p, g in zip(model.parameters(), expected):
        assert torch.equal(p.grad, g)
    for handle in handles:
        handle.remove()
