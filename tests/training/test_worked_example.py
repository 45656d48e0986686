"""docs/objectives.md's worked example: one toy prompt, G = 4 responses, every objective.

This module builds the example's inputs, runs them through groupforge's own code (the
exact_match reward, the label and pair stages' transforms, the registered losses and
agg_loss) and checks that every number in the doc's marked tables is what that code gives,
to the 4 decimals printed. A doc table is marked by a line `<!-- table: NAME -->` right
above it. Change the code or the example and the test fails until the doc is updated:

    python -m tests.training.test_worked_example      # prints the tables to paste into the doc

The walkthrough's per-token and per-sequence pieces use the helpers the losses themselves
use (`log_ratio`, `seq_log_ratio`, `clipped_pg`); test_decomposition_matches_the_losses
checks that the pieces add up to the registered losses.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest
import torch

from curation.rewards.rules import ExactMatch
from curation.stages import pair as pair_stage
from curation.stages.label import LabelConfig, label
from curation.stages.pair import PairConfig
from training.objectives import (
    ObjectiveConfig,
    agg_loss,
    clipped_pg,
    get_pair_loss,
    get_policy_loss,
    log_ratio,
    loss_defaults,
    seq_log_ratio,
)

DOC = Path(__file__).resolve().parents[2] / "docs" / "objectives.md"
DECIMALS = 4
F64 = torch.float64

# ---- the example --------------------------------------------------------------------------

PROMPT, REFERENCE = "37+48=", "85"
EOS = "<eos>"


@dataclass(frozen=True)
class Response:
    text: str
    """What the reward sees (the decoded response, EOS left out)."""
    behavior_logp: tuple[float, ...]
    """Per token, the sampling policy's log-probs (samples.behavior_logprobs; the trainer's old_logp)."""
    logp: tuple[float, ...]
    """Per token, the current policy's log-probs, a few optimizer steps later."""

    @property
    def tokens(self) -> list[str]:  # the toy tokenizer: one token per character, then EOS
        return [*self.text, EOS]


# Round 1: the start model sampled the group, so its log-probs are both the behavior log-probs
# and the frozen reference's. The "8" that starts samples 0, 2 and 3 has one log-prob per policy.
RESPONSES = (
    Response("85", (-0.90, -0.40, -0.05), (-0.80, -0.15, -0.3997)),
    Response("75", (-1.60, -0.70, -0.10), (-1.90, -0.65, -0.09)),
    Response("8", (-0.90, -2.30), (-0.80, -2.28)),
    Response("815", (-0.90, -2.50, -0.30, -0.20), (-0.80, -2.10, -0.30, -0.60)),
)
G = len(RESPONSES)
T = max(len(r.tokens) for r in RESPONSES)


def padded(values: list[tuple[float, ...]]) -> torch.Tensor:
    return torch.tensor([list(v) + [0.0] * (T - len(v)) for v in values], dtype=F64)


def mask() -> torch.Tensor:
    return torch.tensor([[1.0] * len(r.tokens) + [0.0] * (T - len(r.tokens)) for r in RESPONSES], dtype=F64)


def old_logp() -> torch.Tensor:
    return padded([r.behavior_logp for r in RESPONSES])


def current_logp() -> torch.Tensor:
    """A fresh leaf each call, so every loss gets its own gradient."""
    return padded([r.logp for r in RESPONSES]).requires_grad_()


# ---- the stages ---------------------------------------------------------------------------

@functools.cache
def rewards() -> tuple[float, ...]:
    texts = [r.text for r in RESPONSES]
    return tuple(ExactMatch()([PROMPT] * G, texts, reference=[REFERENCE] * G))


def groups(estimator: str = "grpo") -> pa.Table:
    table = pa.table({
        "run_id": ["example"] * G, "round": pa.array([1] * G, pa.int32()), "prompt_id": [PROMPT] * G,
        "sample_idx": pa.array(range(G), pa.int32()), "reward": pa.array(rewards(), pa.float64()),
    })
    return label(table, LabelConfig(estimator=estimator))


def advantages() -> torch.Tensor:
    return torch.tensor(groups().column("advantage").to_pylist(), dtype=F64)


def pairs(**cfg) -> list[dict]:
    return pair_stage.transform({"groups": groups()}, PairConfig(**cfg)).tables["pairs"].to_pylist()


# ---- the losses ---------------------------------------------------------------------------

def policy_cfg(name: str, **overrides) -> ObjectiveConfig:
    """The loss's paper defaults (what TrainConfig gives when they are left unset)."""
    d = loss_defaults(name)
    return ObjectiveConfig(**{"eps_low": d.eps_low, "eps_high": d.eps_high, "beta": d.beta, **overrides})


def policy_loss(name: str, **overrides) -> tuple[float, dict[str, float], torch.Tensor]:
    """(loss, metrics, d loss / d logp) of the registered loss on the example."""
    logp = current_logp()
    loss, metrics = get_policy_loss(name)(logp, old_logp(), advantages(), mask(), policy_cfg(name, **overrides))
    loss.backward()
    return loss.item(), metrics, logp.grad


def pair_loss(chosen: list[int], rejected: list[int], soft_label: list[float], weight: list[float],
              reference: bool) -> tuple[float, dict[str, float]]:
    """The registered pairwise loss on the given pairs (reference: the start model = behavior logps)."""
    logp, old, m = current_logp().detach(), old_logp(), mask()
    ref = {"ref_chosen_logp": old[chosen], "ref_rejected_logp": old[rejected]} if reference else {}
    loss, metrics = get_pair_loss("pairwise")(
        logp[chosen], logp[rejected], m[chosen], m[rejected], torch.tensor(soft_label, dtype=F64),
        torch.tensor(weight, dtype=F64), policy_cfg("pairwise"), **ref)
    return float(loss), metrics


# ---- the doc's tables ---------------------------------------------------------------------

Cell = str | int | float


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[Cell, ...], ...]

    def markdown(self) -> str:
        def cell(x: Cell) -> str:
            return f"{x:.{DECIMALS}f}" if isinstance(x, float) else str(x)
        lines = ["| " + " | ".join(self.headers) + " |", "|" + "---|" * len(self.headers)]
        lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in self.rows]
        return "\n".join(lines)


def code(text: str) -> str:
    return f"`{text}`"


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def settings_table() -> Table:
    grpo, gspo, pairwise = loss_defaults("grpo"), loss_defaults("gspo"), loss_defaults("pairwise")
    return Table(("setting", "value"), (
        ("label eps (grpo estimator)", LabelConfig().eps),
        ("grpo eps_low", grpo.eps_low), ("grpo eps_high", grpo.eps_high),
        ("gspo eps_low", gspo.eps_low), ("gspo eps_high", gspo.eps_high),
        ("pair tau", PairConfig().tau), ("pairwise beta", pairwise.beta),
    ))


def group_table() -> Table:
    g = groups().to_pylist()
    return Table(("sample", "response", "tokens", "reward", "group_mean", "group_std", "advantage"), tuple(
        (i, code(r.text), len(r.tokens), row["reward"], row["group_mean"], row["group_std"], row["advantage"])
        for i, (r, row) in enumerate(zip(RESPONSES, g))))


def estimators_table() -> Table:
    estimators = ("grpo", "dr_grpo", "rloo", "batch")
    return Table(("estimator", *(f"A_{i}" for i in range(G))), tuple(
        (e, *groups(e).column("advantage").to_pylist()) for e in estimators))


def tokens_table() -> Table:
    log_ratios = log_ratio(current_logp().detach(), old_logp(), mask())
    rows = []
    for i, r in enumerate(RESPONSES):
        for t, token in enumerate(r.tokens):
            rows.append((i, t, code(token), r.behavior_logp[t], r.logp[t], float(log_ratios[i, t]),
                         float(torch.exp(log_ratios[i, t]))))
    return Table(("sample", "t", "token", "old_logp", "logp", "logp - old_logp", "r_it"), tuple(rows))


def grpo_tokens_table() -> Table:
    cfg = policy_cfg("grpo")
    adv = advantages()
    ratio = torch.exp(log_ratio(current_logp().detach(), old_logp(), mask()))
    per_token, _ = clipped_pg(ratio, adv[:, None], cfg)
    grad = policy_loss("grpo")[2]
    rows = []
    for i, r in enumerate(RESPONSES):
        for t in range(len(r.tokens)):
            clipped = float(ratio[i, t].clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
            rows.append((i, t, float(adv[i]), float(ratio[i, t]), clipped, float(per_token[i, t]),
                         yes_no(float(grad[i, t]) == 0.0), float(grad[i, t])))
    return Table(("sample", "t", "A_i", "r_it", "clip(r_it)", "l_it", "clipped", "dloss/dlogp_it"), tuple(rows))


def grpo_loss_table() -> Table:
    rows = [(f"loss, agg = {mode}", policy_loss("grpo", agg=mode)[0])
            for mode in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")]
    metrics = policy_loss("grpo")[1]
    rows += [(key, metrics[key]) for key in ("clip_frac_low", "clip_frac_high", "ratio_min", "ratio_max")]
    return Table(("grpo", "value"), tuple(rows))


def gspo_sequences_table() -> Table:
    cfg = policy_cfg("gspo")
    adv, m = advantages(), mask()
    mean_log_ratio = seq_log_ratio(current_logp().detach(), old_logp(), m)
    ratio = torch.exp(mean_log_ratio)
    per_seq, _ = clipped_pg(ratio, adv, cfg)
    grad = policy_loss("gspo")[2]
    rows = []
    for i, r in enumerate(RESPONSES):
        token_grads = grad[i, :len(r.tokens)]
        assert torch.allclose(token_grads, token_grads[0].expand_as(token_grads)), "gspo: one gradient per sequence"
        clipped = float(ratio[i].clamp(1 - cfg.eps_low, 1 + cfg.eps_high))
        rows.append((i, len(r.tokens), float(mean_log_ratio[i]), float(ratio[i]), clipped, float(adv[i]),
                     float(per_seq[i]), yes_no(float(token_grads[0]) == 0.0), float(token_grads[0])))
    return Table(("sample", "tokens", "mean log-ratio", "s_i", "clip(s_i)", "A_i", "l_i", "clipped",
                  "dloss/dlogp_it (each token)"), tuple(rows))


def gspo_loss_table() -> Table:
    loss, metrics, _ = policy_loss("gspo")
    rows = [("loss", loss), ("gspo_token loss (same advantages)", policy_loss("gspo_token")[0])]
    rows += [(key, metrics[key]) for key in ("clip_frac_low", "clip_frac_high", "ratio_min", "ratio_max")]
    rows += [("loss with GRPO's clip range 0.2 / 0.2", policy_loss("gspo", eps_low=0.2, eps_high=0.2)[0])]
    return Table(("gspo", "value"), tuple(rows))


def pairs_table() -> Table:
    rows = []
    for strategy in ("max_min", "all_pairs"):
        for p in pairs(strategy=strategy):
            rows.append((strategy, p["chosen_idx"], p["rejected_idx"], p["margin"], p["soft_label"], p["weight"]))
    return Table(("strategy", "chosen", "rejected", "margin", "soft_label", "weight"), tuple(rows))


def pair_terms_table() -> Table:
    logp, old, m = current_logp().detach(), old_logp(), mask()
    seq_logp = (logp * m).sum(-1)
    ref_logp = (old * m).sum(-1)
    rows = []
    for p in pairs(strategy="all_pairs"):
        chosen, rejected, soft_label = p["chosen_idx"], p["rejected_idx"], p["soft_label"]
        plain_loss, plain = pair_loss([chosen], [rejected], [soft_label], [1.0], reference=False)
        ref_loss, ref = pair_loss([chosen], [rejected], [soft_label], [1.0], reference=True)
        rows.append((chosen, rejected, float(seq_logp[chosen]), float(seq_logp[rejected]), plain["margin_mean"],
                     plain_loss, float(ref_logp[chosen]), float(ref_logp[rejected]), ref["margin_mean"], ref_loss))
    return Table(("chosen", "rejected", "L_w", "L_l", "h, no reference", "l_k, no reference",
                  "Lref_w", "Lref_l", "h, reference", "l_k, reference"), tuple(rows))


def pair_loss_table() -> Table:
    rows = []
    for strategy, reference, hard in (("max_min", True, False), ("max_min", False, False),
                                      ("all_pairs", True, False), ("all_pairs", False, False),
                                      ("all_pairs", True, True)):
        ps = pairs(strategy=strategy, hard=hard)
        loss, _ = pair_loss([p["chosen_idx"] for p in ps], [p["rejected_idx"] for p in ps],
                            [p["soft_label"] for p in ps], [p["weight"] for p in ps], reference)
        what = f"{strategy}, {'reference' if reference else 'no reference'}, {'hard' if hard else 'soft'} labels"
        rows.append((what, loss))
    return Table(("pairwise loss", "value"), tuple(rows))


def sft_rows() -> list[int]:
    """training/data.py's sft selection: the samples with advantage > 0."""
    return [row["sample_idx"] for row in groups().to_pylist() if row["advantage"] > 0]


def sft_table() -> Table:
    keep = sft_rows()
    logp = padded([RESPONSES[i].logp for i in keep]).requires_grad_()
    m = mask()[keep]
    loss, _ = get_policy_loss("sft")(logp, None, None, m, policy_cfg("sft"))
    loss.backward()
    grads = logp.grad[m > 0]
    assert torch.allclose(grads, grads[0].expand_as(grads)), "sft: one gradient for every token of a sequence"
    return Table(("sft", "value"), (
        ("samples trained on", ", ".join(str(i) for i in keep)),
        ("loss = agg(-logp), seq-mean-token-mean", loss.item()),
        ("dloss/dlogp_it (each token)", float(grads[0])),
    ))


TABLES = {
    "settings": settings_table,
    "group": group_table,
    "estimators": estimators_table,
    "tokens": tokens_table,
    "grpo-tokens": grpo_tokens_table,
    "grpo-loss": grpo_loss_table,
    "gspo-sequences": gspo_sequences_table,
    "gspo-loss": gspo_loss_table,
    "pairs": pairs_table,
    "pair-terms": pair_terms_table,
    "pair-loss": pair_loss_table,
    "sft": sft_table,
}


# ---- reading the doc ----------------------------------------------------------------------

MARK = re.compile(r"^<!-- table: ([\w-]+) -->$")


def doc_tables(text: str) -> dict[str, list[list[str]]]:
    """NAME -> the cells of the markdown table right after `<!-- table: NAME -->` (header first,
    the |---| line left out)."""
    out: dict[str, list[list[str]]] = {}
    lines = text.splitlines()
    for n, line in enumerate(lines):
        found = MARK.match(line.strip())
        if not found:
            continue
        assert found.group(1) not in out, f"table {found.group(1)!r} is marked twice"
        rows = []
        for row in lines[n + 1:]:
            if not row.startswith("|"):
                break
            if not re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", row.strip()):
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
        out[found.group(1)] = rows
    return out


def compare(name: str, expected: Table, got: list[list[str]]) -> None:
    assert got, f"table {name!r}: no markdown table under its mark"
    assert tuple(got[0]) == expected.headers, f"table {name!r}: headers"
    assert len(got) - 1 == len(expected.rows), \
        f"table {name!r}: {len(got) - 1} rows, the code gives {len(expected.rows)}"
    for row, (want, have) in enumerate(zip(expected.rows, got[1:])):
        assert len(have) == len(want), f"table {name!r} row {row}: {len(have)} cells, expected {len(want)}"
        for col, (w, h) in enumerate(zip(want, have)):
            where = f"table {name!r}, row {row}, column {expected.headers[col]!r}"
            if isinstance(w, float):
                # the doc prints DECIMALS decimals: a correctly rounded value is within half a unit
                assert abs(float(h) - w) <= 0.5 * 10 ** -DECIMALS + 1e-9, f"{where}: doc {h}, code {w:.6f}"
            else:
                assert h == str(w), f"{where}: doc {h!r}, code {w!r}"


# ---- tests --------------------------------------------------------------------------------

@functools.cache
def the_doc() -> dict[str, list[list[str]]]:
    return doc_tables(DOC.read_text())


def test_doc_marks_exactly_these_tables():
    assert sorted(the_doc()) == sorted(TABLES)


@pytest.mark.parametrize("name", list(TABLES))
def test_doc_numbers_are_the_codes(name):
    compare(name, TABLES[name](), the_doc()[name])


def test_a_drifted_number_fails():
    table = TABLES["grpo-loss"]()
    cells = [list(table.headers)] + [[f"{x:.{DECIMALS}f}" if isinstance(x, float) else str(x) for x in row]
                                     for row in table.rows]
    compare("grpo-loss", table, cells)
    cells[1][1] = f"{float(cells[1][1]) + 2 * 10 ** -DECIMALS:.{DECIMALS}f}"
    with pytest.raises(AssertionError, match="grpo-loss"):
        compare("grpo-loss", table, cells)


def test_the_example_is_what_the_doc_says():
    """The story the prose tells: one correct answer, the shared first token, a kept group."""
    assert rewards() == (1.0, 0.0, 0.0, 0.0)
    assert all(r.behavior_logp[0] == RESPONSES[0].behavior_logp[0] and r.logp[0] == RESPONSES[0].logp[0]
               for r in RESPONSES if r.text.startswith("8"))
    assert groups().column("group_kept").to_pylist() == [True] * G
    assert sft_rows() == [0]


def test_decomposition_matches_the_losses():
    """The doc's per-token and per-sequence pieces reduce to the registered losses."""
    m, adv = mask(), advantages()
    ratio = torch.exp(log_ratio(current_logp().detach(), old_logp(), m))
    for mode in ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"):
        per_token, _ = clipped_pg(ratio, adv[:, None], policy_cfg("grpo"))
        assert float(agg_loss(per_token, m, mode)) == pytest.approx(policy_loss("grpo", agg=mode)[0], abs=1e-12)
    seq_ratio = torch.exp(seq_log_ratio(current_logp().detach(), old_logp(), m))
    per_seq, _ = clipped_pg(seq_ratio, adv, policy_cfg("gspo"))
    assert float(per_seq.mean()) == pytest.approx(policy_loss("gspo")[0], abs=1e-12)
    assert policy_loss("gspo_token")[0] == pytest.approx(policy_loss("gspo")[0], abs=1e-12)
    assert torch.allclose(policy_loss("gspo_token")[2], policy_loss("gspo")[2], atol=1e-12)
    # all_pairs with uniform weights: the loss is the mean of the per-pair losses
    terms = TABLES["pair-terms"]().rows
    by_name = dict(TABLES["pair-loss"]().rows)
    assert by_name["all_pairs, reference, soft labels"] == pytest.approx(sum(r[-1] for r in terms) / len(terms))
    assert by_name["all_pairs, no reference, soft labels"] == pytest.approx(sum(r[5] for r in terms) / len(terms))


if __name__ == "__main__":
    for name, make in TABLES.items():
        print(f"<!-- table: {name} -->\n{make().markdown()}\n")
