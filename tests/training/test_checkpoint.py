"""training/checkpoint.py: a checkpoint is an ordinary HF folder plus optimizer and trainer
state, written atomically, loaded exactly, never pickled; old and half-written ones go."""

from __future__ import annotations

import json

import pytest
import torch

from store.run_files import OPTIMIZER_FILE, TRAINER_STATE_FILE
from training import checkpoint as ckpt
from training.config import TrainConfig
from training.trainer import train


def _adamw_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int = 0) -> None:
    torch.manual_seed(seed)
    for _ in range(steps):
        optimizer.zero_grad()
        ids = torch.randint(0, model.config.vocab_size, (2, 5))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()


@pytest.fixture
def trained(toy_dir):
    """The toy model after two AdamW steps: (model, optimizer)."""
    model = ckpt.load_model(toy_dir / "model", trainable=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    _adamw_steps(model, optimizer, 2)
    return model, optimizer


def test_optimizer_state_round_trips_without_pickle(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
    from safetensors.torch import load_file, save_file

    tensors, groups = ckpt.optimizer_to_tensors(opt)
    save_file(tensors, tmp_path / "opt.safetensors")  # as a checkpoint stores them (on CPU the
    tensors = load_file(tmp_path / "opt.safetensors")  # exported tensors alias the live state)
    groups = json.loads(json.dumps(groups))
    twin = torch.nn.Linear(4, 3)
    twin.load_state_dict(model.state_dict())
    opt2 = torch.optim.AdamW(twin.parameters(), lr=5.0)
    ckpt.optimizer_from_tensors(opt2, tensors, groups)
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        m(x).pow(2).sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
    with pytest.raises(ValueError, match="different parameter groups"):
        ckpt.optimizer_from_tensors(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))]), tensors, groups)


def test_save_then_load_is_exact(trained, toy_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, optimizer = trained
    folder = ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {"base_model": str(toy_dir / "model"), "note": 1},
                                  tokenizer_from=toy_dir / "model")
    assert folder == ckpt.checkpoint_dir(tmp_path, 2) == tmp_path / "checkpoints" / "step-2"
    assert ckpt.checkpoint_steps(tmp_path) == [2] and ckpt.latest_checkpoint(tmp_path) == folder
    state = ckpt.load_trainer_state(folder)
    assert state["step"] == 2 and state["note"] == 1 and state["base_model"] == str(toy_dir / "model")
    group = state["optimizer_param_groups"][0]
    assert group["lr"] == 1e-3 and group["betas"] == [0.9, 0.999] and group["weight_decay"] == 0.1

    # An ordinary HF folder: transformers loads weights and tokenizer without groupforge.
    plain = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), model.state_dict().values()))
    assert AutoTokenizer.from_pretrained(folder)("1+1=").input_ids

    # Weights and optimizer state reloaded: the next steps are bit-identical to the original's.
    again = ckpt.load_model(folder, trainable=True)
    again_opt = torch.optim.AdamW(again.parameters(), lr=0.5)
    ckpt.load_optimizer(again_opt, folder)
    assert again_opt.param_groups[0]["lr"] == 1e-3 and again_opt.param_groups[0]["weight_decay"] == 0.1
    for p, q in zip(model.parameters(), again.parameters()):
        a, b = optimizer.state[p], again_opt.state[q]
        assert set(a) == set(b) == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(a[k], b[k]) for k in a)
    _adamw_steps(model, optimizer, 2, seed=1)
    _adamw_steps(again, again_opt, 2, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))


def test_nothing_is_pickled(trained, toy_dir, tmp_path):
    model, optimizer = trained
    folder = ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, tokenizer_from=toy_dir / "model")
    names = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert {"config.json", "model.safetensors", OPTIMIZER_FILE, TRAINER_STATE_FILE, "tokenizer.json"} <= set(names)
    assert [p.name for p in folder.glob("*.safetensors")] == ["model.safetensors"]  # what vLLM loads as weights
    for path in (p for p in folder.rglob("*") if p.is_file()):
        head = path.read_bytes()[:2]
        # pickle protocol 2+ starts with 0x80; torch.save writes a zip (PK)
        assert head[:1] != b"\x80" and head != b"PK", path.name
        assert path.suffix in (".json", ".safetensors", ".jinja", ".txt", ".model"), path.name
    with pytest.raises(ValueError, match=r"no \*\.safetensors files \(pickled weights are not loaded\)"):
        (tmp_path / "pickled").mkdir()
        torch.save(model.state_dict(), tmp_path / "pickled" / "pytorch_model.bin")
        ckpt.load_model(tmp_path / "pickled")


def test_a_killed_save_leaves_only_a_tmp_folder_which_the_next_save_removes(trained, tmp_path):
    model, optimizer = trained
    root = tmp_path / "checkpoints"
    killed = root / ".tmp-step-3-99999"  # a save killed before its rename
    killed.mkdir(parents=True)
    (killed / "model.safetensors").write_bytes(b"partial")
    half = ckpt.checkpoint_dir(tmp_path, 9)  # a step folder without trainer_state.json
    half.mkdir()
    assert ckpt.checkpoint_steps(tmp_path) == [] and ckpt.latest_checkpoint(tmp_path) is None
    ckpt.save_checkpoint(tmp_path, 3, model, optimizer, {})
    assert not killed.exists() and not list(root.glob(".tmp-*"))
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.checkpoint_dir(tmp_path, 3)
    assert not list(ckpt.checkpoint_dir(tmp_path, 3).glob("*.tmp"))  # no temporary files inside either
    # Saving the same step again (a rerun after a kill between rename and pruning) replaces it.
    ckpt.save_checkpoint(tmp_path, 3, model, optimizer, {"again": True})
    assert ckpt.load_trainer_state(ckpt.checkpoint_dir(tmp_path, 3))["again"] is True


def test_keep_last(trained, tmp_path):
    model, optimizer = trained
    for step in (1, 2, 3, 4):
        ckpt.save_checkpoint(tmp_path, step, model, optimizer, {}, keep_last=2)
    assert ckpt.checkpoint_steps(tmp_path) == [3, 4]
    ckpt.save_checkpoint(tmp_path, 5, model, optimizer, {})  # None: keep all
    assert ckpt.checkpoint_steps(tmp_path) == [3, 4, 5]
    # The newest keep_last are kept, and the one just saved is never pruned (a rerun of an old step).
    ckpt.save_checkpoint(tmp_path, 2, model, optimizer, {}, keep_last=1)
    assert ckpt.checkpoint_steps(tmp_path) == [2, 5]


def test_unreadable_trainer_state_names_the_checkpoint(tmp_path):
    folder = tmp_path / "checkpoints" / "step-1"
    folder.mkdir(parents=True)
    with pytest.raises(ValueError, match=rf"checkpoint {folder}: no {TRAINER_STATE_FILE}"):
        ckpt.load_trainer_state(folder)
    (folder / TRAINER_STATE_FILE).write_text("{cut")
    with pytest.raises(ValueError, match=rf"checkpoint {folder}: cannot read {TRAINER_STATE_FILE}"):
        ckpt.load_trainer_state(folder)


def test_incomplete_checkpoints_are_ignored_and_old_ones_pruned(run_copy, toy_dir):
    train(run_copy, TrainConfig(batch_size=8, lr=1e-4, save_every=1, keep_last=2), steps=3, model=toy_dir / "model")
    assert ckpt.checkpoint_steps(run_copy) == [2, 3]
    half = ckpt.checkpoint_dir(run_copy, 9)  # a folder without trainer_state.json: a kill mid-save
    half.mkdir()
    (half / "model.safetensors").write_bytes(b"partial")
    assert ckpt.latest_checkpoint(run_copy) == ckpt.checkpoint_dir(run_copy, 3)
