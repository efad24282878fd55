"""The inspector page in a real headless browser (Debian's chromium, driven by playwright): the page of
a real GRPO run and of a multi-turn run, written to a file or served, loads with no console error and no
network request; a click on a response shows its tokens with the run's numbers; colours, filters and
the side-by-side view do what they say (counts and colours checked against the run's own files); the
consistency check's verdicts (check.jsonl) show as a list and as marks on the curves, its counts on a
chart of their own and its differences on a log scale."""

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import recipes.grpo
import recipes.multi_turn_grpo
from rlcore.inspect import write_page
from rlcore.inspect.server import InspectorServer
from rlcore.models.tiny import build_tiny_model
from rlcore.trainer.tracking import read_jsonl_metrics
from rlcore.trainer.verdicts import VerdictLog

sync_api = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' (scripts/setup.sh)")
pytestmark = pytest.mark.slow
CONFIG_DIR = Path(recipes.grpo.__file__).parent / "config"
DIGIT_REWARD = f"{Path(__file__).with_name('digit_reward.py')}:digit_share"
RUN = ["trainer.loggers=[jsonl]", "trainer.total_steps=2", "trainer.val_freq=1", "trainer.backend=local",
       "trainer.trajectory_groups=2", "data.train_batch_size=4", "data.arithmetic.n_train=16", "data.arithmetic.n_val=6",
       "actor.ppo_micro_batch_size_per_gpu=8", "rollout.n=3", "rollout.max_new_tokens=6"]


def chromium() -> str:
    """The system chromium (scripts/setup.sh installs it): RLCORE_CHROMIUM, else Debian's binary."""
    for candidate in (os.environ.get("RLCORE_CHROMIUM"), "/usr/lib/chromium/chromium", shutil.which("chromium"),
                      shutil.which("chromium-browser")):
        if candidate and Path(candidate).is_file():
            return candidate
    pytest.fail("no chromium: run scripts/setup.sh as root (apt-get install chromium) or set RLCORE_CHROMIUM")


@pytest.fixture(scope="module")
def browser(grpo_run, multi_turn_run):
    """After the runs: playwright's sync API keeps an event loop running in this thread, in which the
    multi-turn rollout's asyncio.run could not start."""
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])  # root in CI: no user namespace
        yield b
        b.close()


class Page:
    """A tab that records console errors, page errors and every request that is not the page's own file."""

    def __init__(self, browser, url: str) -> None:
        self.errors, self.requests = [], []
        self.tab = browser.new_page(viewport={"width": 1280, "height": 900})
        self.tab.set_default_timeout(10_000)  # everything is local: a wait this long is a failure
        self.tab.on("console", lambda m: m.type in ("error", "warning") and self.errors.append(m.text))
        self.tab.on("pageerror", lambda e: self.errors.append(str(e)))
        self.tab.route("**/*", self.route)
        self.url = url
        self.response = self.tab.goto(url)

    def route(self, route) -> None:
        if route.request.url.split("?")[0] == self.url.split("?")[0]:
            route.continue_()
        else:
            self.requests.append(route.request.url)
            route.abort()

    def close(self) -> None:
        self.tab.close()
        assert not self.errors, self.errors
        assert not self.requests, f"the page asked the network for {self.requests}"


def train(recipe, tmp_path: Path, name: str, *overrides: str) -> Path:
    model = build_tiny_model(tmp_path / "model", hidden_size=64, num_heads=2, num_kv_heads=1)
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        cfg = compose(name, overrides=[f"trainer.output_dir={tmp_path}", f"model.path={model}", *RUN, *overrides])
    return recipe.train(cfg).dir


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory) -> Path:
    # two optimizer steps per batch: the trainer's log-probs of the sampled tokens (old_log_probs) are in the batch
    return train(recipes.grpo, tmp_path_factory.mktemp("grpo"), "grpo", f"reward.reward_fn={DIGIT_REWARD}",
                 "actor.ppo_mini_batch_size=2")


@pytest.fixture(scope="module")
def multi_turn_run(tmp_path_factory) -> Path:
    return train(recipes.multi_turn_grpo, tmp_path_factory.mktemp("multi_turn"), "multi_turn_grpo",
                 "env.max_total_tokens=40", "trainer.trajectory_groups=1")


def records(run: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]


def shown(tab, step: int) -> list[int]:
    return [int(x) for x in tab.eval_on_selector_all(f'.panel[data-step="{step}"] .resp', "ns => ns.map(n => n.dataset.row)")]


def number(detail: str, label: str) -> float:
    return float(re.search(rf"{label} (-?[0-9.e-]+)", detail).group(1))


def test_page_of_a_grpo_run_shows_curves_tokens_colours_filters(browser, grpo_run):
    page = Page(browser, write_page(grpo_run).as_uri())
    tab = page.tab
    assert "grpo" in tab.inner_text("header h1")
    # the reward chart: one point per logged value of its keys
    rows = read_jsonl_metrics(grpo_run / "metrics.jsonl")
    logged = sum(isinstance(r.get(k), float) for r in rows for k in ("reward/score/mean", "val/reward_mean"))
    assert tab.locator('.chart[data-chart="Reward"] circle').count() == logged == 5
    assert tab.locator('.chart[data-chart="KL"] path').count() >= 1
    # the sample's own trainer-vs-sampler curves (mean and max |diff|), one point per sampled step
    mismatch = tab.locator('.chart[data-chart^="Trainer vs sampler"]')
    assert tab.inner_text("#checks .summary") == "2 steps judged · 2 ok · no warning"  # the run's check.jsonl
    assert tab.locator(".warn-marker").count() == 0
    assert mismatch.locator(".legend span").all_inner_texts()[-2:] == ["sample/logprob_abs_diff_max",
                                                                       "sample/logprob_abs_diff_mean"]
    assert mismatch.locator('circle title', has_text="sample/logprob_abs_diff_mean").count() == 2

    recs = {r["row"]: r for r in records(grpo_run, 2)}  # the last step is shown first
    assert sorted(shown(tab, 2)) == sorted(recs) and len(recs) == 6  # 2 groups x rollout.n 3
    row = shown(tab, 2)[0]
    rec = recs[row]
    resp = tab.locator(f'.panel[data-step="2"] .resp[data-row="{row}"]')
    assert resp.locator(".tok").count() == 0  # tokens only once clicked
    resp.locator(".bar").click()
    toks = resp.locator(".tok")
    assert toks.count() == rec["length"] and rec["length"] > 0
    assert "".join(toks.all_inner_texts()).replace("↵", "") == "".join(rec["pieces"])
    toks.nth(rec["length"] - 1).click()
    detail = resp.locator(".detail").inner_text()
    j = rec["length"] - 1
    assert number(detail, "sampler lp") == pytest.approx(rec["sampler_logprob"][j], abs=1e-4)
    assert number(detail, "trainer lp") == pytest.approx(rec["trainer_logprob"][j], abs=1e-4)
    assert number(detail, "advantage") == pytest.approx(rec["advantages"][j], abs=1e-4)

    # advantage colours: green above 0, red below, none at 0, for every token of every open response
    for r in recs.values():
        if r["row"] != row:  # the one clicked above is open
            tab.locator(f'.panel[data-step="2"] .resp[data-row="{r["row"]}"] .bar').click()
    assert any(r["advantage"] for r in recs.values())  # the digit reward tells samples apart
    for r in recs.values():
        colours = tab.locator(f'.resp[data-row="{r["row"]}"] .tok').evaluate_all("ns => ns.map(n => n.style.background)")
        want = "26, 127, 55" if r["advantage"] > 0 else "207, 34, 46" if r["advantage"] < 0 else "0)"
        assert all(want in c for c in colours), (r["advantage"], colours)
    tab.select_option("#mode", "ratio")  # redrawn in the new colours, the open responses still open
    assert tab.locator(".note", has_text="no trainer log-probs").count() == 0
    assert tab.locator('.panel[data-step="2"] .resp.open').count() == len(recs)
    for r in recs.values():
        colours = tab.locator(f'.resp[data-row="{r["row"]}"] .tok').evaluate_all("ns => ns.map(n => n.style.background)")
        for c, s, t in zip(colours, r["sampler_logprob"], r["trainer_logprob"]):
            want = "188, 76, 0" if t > s else "9, 105, 218" if t < s else "0)"  # orange: trainer above the sampler
            assert want in c, (s, t, c)

    # filters: reward range and truncation, counted against the records
    rewards = sorted(r["reward"] for r in recs.values())
    cut = rewards[len(rewards) // 2]
    tab.fill("#reward-min", str(cut))
    assert sorted(shown(tab, 2)) == sorted(r["row"] for r in recs.values() if r["reward"] >= cut)
    tab.fill("#reward-min", "")
    tab.select_option("#trunc", "complete")
    assert sorted(shown(tab, 2)) == sorted(r["row"] for r in recs.values() if not r["truncated"])
    tab.select_option("#trunc", "all")
    tab.select_option("#source", "arithmetic")
    assert len(shown(tab, 2)) == 6

    # two steps side by side
    tab.check("#compare")
    assert tab.eval_on_selector_all(".panel", "ns => ns.map(n => n.dataset.step)") == ["2", "1"]
    assert sorted(shown(tab, 1)) == sorted(r["row"] for r in records(grpo_run, 1))
    page.close()


def test_served_page_needs_the_token(browser, grpo_run):
    server = InspectorServer(grpo_run)
    server.start()
    try:
        page = Page(browser, server.url)
        assert page.response.status == 200 and page.tab.locator(".resp").count() == 6
        page.close()
        refused = browser.new_page()
        assert refused.goto(server.url.split("?")[0]).status == 403
        refused.close()
    finally:
        server.shutdown()
        server.server_close()


def test_multi_turn_episode_shows_its_turns(browser, multi_turn_run):
    run = multi_turn_run
    rec = records(run, 2)[0]
    assert rec["num_turns"] > 1  # a random model is never right: it uses its tries
    page = Page(browser, write_page(run).as_uri())
    resp = page.tab.locator(f'.resp[data-row="{rec["row"]}"]')
    resp.locator(".bar").click()
    policy, env = resp.locator(".seg.policy"), resp.locator(".seg.env")
    assert policy.count() == rec["num_turns"] and env.count() == sum(k == "env" for k, _, _ in rec["segments"]) >= 1
    assert policy.nth(1).locator(".label").inner_text().startswith("policy · turn 2")
    assert env.first.locator(".tok.masked").count() == 0  # env text is not the policy's: not marked as masked
    env.first.locator(".tok").first.click()
    assert "env / tool token" in resp.locator(".detail").inner_text()
    policy.nth(1).locator(".tok").first.click()  # the step's policy sampled it, whatever the lockstep engine says
    assert f"version {rec['policy_version']} (lag 0)" in resp.locator(".detail").inner_text()
    # a default run (one optimizer step, no old_log_probs): the trainer's log-probs are in the sample all the same
    assert rec["trainer_logprob"] is not None
    assert number(resp.locator(".detail").inner_text(), "trainer lp") == pytest.approx(
        rec["trainer_logprob"][[seg for seg in rec["segments"] if seg[0] == "policy"][1][1]], abs=1e-4)
    page.tab.select_option("#mode", "ratio")
    assert page.tab.locator(".note", has_text="no trainer log-probs").count() == 0
    page.close()


def test_check_warnings_mark_the_curves_and_are_listed_counts_apart(browser, tmp_path):
    """Hand-written files: ~1500 tokens judged per step, differences of 1e-7 but 0.3 at step 2, where the
    check warned (rows written by the run's own writer)."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "check/tokens": 1500.0 + s, "check/logprob_abs_diff_mean": 0.3 if s == 2 else 1e-7,
             "check/logprob_diff_mean": -1e-8, "check/weights_covered": 1.0, "reward/score/mean": s / 10}
            for s in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    log = VerdictLog(run)
    for r in rows:
        log.begin(r["step"], r)
        if r["step"] == 2:
            log.warning(2, "weights_partial", "weights partly synced: <b>1</b> of 21", ["model.layers.1.mlp.up_proj.weight"])
        log.verdict(r["step"], r)
    page = Page(browser, write_page(run).as_uri())
    tab = page.tab
    assert tab.inner_text("#checks .summary") == "3 steps judged · 2 ok · warnings at step(s) 2"
    listed = tab.locator("#checks tr.warning")
    assert listed.count() == 1 and listed.locator("td").all_inner_texts()[:3] == ["2", "warning", "weights_partial"]
    assert "weights partly synced: <b>1</b> of 21" in listed.inner_text()  # text, not markup
    assert "model.layers.1.mlp.up_proj.weight" in listed.inner_text()
    diffs = tab.locator('.chart[data-chart^="Trainer vs sampler"]')
    counts = tab.locator('.chart[data-chart="Consistency check: counts"]')
    assert diffs.locator("svg").get_attribute("data-scale") == "log"
    assert "check/tokens" not in diffs.locator(".legend").inner_text()
    assert counts.locator(".legend").inner_text().strip() == "check/tokens"
    covered = tab.locator('.chart[data-chart="Consistency check: share of the weights verified"]')
    assert covered.locator(".legend").inner_text().strip() == "check/weights_covered"  # a share: neither chart above
    assert "check/weights_covered" not in diffs.locator(".legend").inner_text()
    # every chart with points at step 2 marks it; none marks another step
    assert tab.locator('.warn-marker[data-step="2"]').count() == 4 == tab.locator(".warn-marker").count()
    assert diffs.locator("circle.warned").count() == 2  # both difference series' points at step 2
    # the mismatch stands out: step 2's point well above steps 1 and 3 (most of the plot's height), and
    # the signed mean (negative) on the same axis, below them
    points = diffs.locator("circle").evaluate_all("ns => ns.map(n => [n.textContent, +n.getAttribute('cy')])")
    cy = {(key.split("\n")[0], int(re.search(r"step (\d+)", key).group(1))): y for key, y in points}
    abs_mean = "check/logprob_abs_diff_mean"
    assert cy[abs_mean, 1] == cy[abs_mean, 3] and cy[abs_mean, 1] - cy[abs_mean, 2] > 0.5 * 106  # plot height: 130 - margins
    assert cy["check/logprob_diff_mean", 1] > cy[abs_mean, 1]  # a negative value, below 1e-7 on the same axis
    tab.locator("#checks tr.warning").click()  # no trajectories: nothing to select, and no error
    page.close()


def test_chat_segments_group_by_episode_and_text_stays_text(browser, tmp_path):
    """Hand-written files: one chat-agent episode of two segments, and token text that is markup."""
    run = tmp_path / "run"
    (run / "trajectories").mkdir(parents=True)
    evil = "</script><img src=x onerror=window.pwned=1>"
    base = {"step": 1, "group": "0", "data_source": "chat", "ground_truth": "4", "reward": 1.0, "advantage": 0.5,
            "truncated": False, "num_turns": None, "policy_version": 0, "prompt_ids": [1], "prompt_pieces": ["2+2="],
            "sampler_logprob": [-0.5, -0.5], "trainer_logprob": None, "advantages": [0.5, 0.5], "length": 2,
            "versions": [0, 0], "mask": [1, 1], "segments": [["policy", 0, 2]], "ids": [5, 6]}
    lines = [{**base, "row": 0, "episode": "e7", "pieces": ["4", evil]},
             {**base, "row": 1, "episode": "e7", "pieces": ["o", "k"], "mask": [1, 0]},  # "k" out of the loss
             {**base, "row": 2, "episode": "e8", "pieces": ["5", "!"], "reward": 0.0}]
    (run / "trajectories" / "step_000001.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    bare = {"step": 2, "row": 0, "group": "0", "pieces": ["a", "b", "c"], "reward": None}  # what a record needs
    (run / "trajectories" / "step_000002.jsonl").write_text(json.dumps(bare) + "\n")
    page = Page(browser, write_page(run).as_uri())
    tab = page.tab
    tab.locator('.panel[data-step="2"] .resp .bar').click()
    assert tab.locator('.panel[data-step="2"] .tok').all_inner_texts() == ["a", "b", "c"]
    tab.fill("#reward-min", "0")
    assert tab.locator('.panel[data-step="2"] .resp').count() == 0  # no reward: not in any range
    tab.fill("#reward-min", "")
    tab.select_option("#step-a", "1")
    assert tab.locator(".episode-head").all_inner_texts() == ["episode e7 · 2 segments"]
    assert tab.locator(".resp .bar > .num:first-child").all_inner_texts() == ["segment 1", "segment 2", "row 2"]
    tab.locator('.resp[data-row="0"] .bar').click()
    assert tab.locator('.resp[data-row="0"] .tok').nth(1).inner_text() == evil
    assert tab.evaluate("window.pwned") is None and tab.locator("img").count() == 0
    tab.locator('.resp[data-row="1"] .bar').click()
    assert tab.locator('.resp[data-row="1"] .tok.masked').all_inner_texts() == ["k"]
    assert tab.locator('.resp[data-row="0"] .tok.masked').count() == 0
    assert tab.locator('.resp[data-row="1"] .tok.masked').evaluate("n => getComputedStyle(n).textDecorationLine") == "line-through"
    tab.select_option("#mode", "ratio")
    assert tab.locator(".note", has_text="no trainer log-probs").count() == 1  # said, not drawn as ratio 1
    assert "not logged by this run" in tab.inner_text('.chart[data-chart="Reward"]')  # no metrics.jsonl
    page.close()
