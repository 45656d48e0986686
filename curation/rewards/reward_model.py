"""A learned reward: a sequence-classification model from a local folder, scored in batches.

The model runs in the score stage's own process (`isolate = False`): one copy of the
weights, batched forwards, no per-item worker. Only local folders load (no hub), only
safetensors weights, and never remote code.
"""

from __future__ import annotations

from pathlib import Path

from curation.rewards.registry import completion_text, register_reward


@register_reward("reward_model")
class RewardModel:
    """The logit of `label` (or the single logit) of AutoModelForSequenceClassification on
    prompt + completion; chat prompts go through the tokenizer's chat template.

    `label` is an index or a name from the model's id2label; a one-logit model needs none.
    Texts are sorted by length and scored `batch_size` at a time (padding does not change
    a score: the model reads the last non-pad token). With `max_length`, texts are cut from
    the left so the completion's end is kept.

    >>> rm = RewardModel("path/to/rm")                                  # doctest: +SKIP
    >>> rm(["2+2="], ["4"])                                             # doctest: +SKIP
    [1.73]
    """

    isolate = False

    def __init__(self, path: str, label: int | str | None = None, batch_size: int = 16,
                 max_length: int | None = None, device: str = "cpu", dtype: str = "float32"):
        self.path, self.label, self.batch_size = str(path), label, batch_size
        self.max_length, self.device, self.dtype = max_length, device, dtype
        self._version: str | None = None
        self._loaded = None  # (tokenizer, model, logit index)

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_loaded"} | {"_loaded": None}

    @property
    def version(self) -> str:
        """'1+' and the first 12 hex digits of the weights' sha256: new weights, new scores."""
        if self._version is None:
            from store.weights import weights_fingerprint

            self._version = "1+" + weights_fingerprint(Path(self.path))[:12]
        return self._version

    def _load(self):
        if self._loaded is not None:
            return self._loaded
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = Path(self.path)
        if not folder.is_dir():
            raise FileNotFoundError(f"reward model folder {folder} does not exist (only local folders load)")
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True, trust_remote_code=False)
        model = AutoModelForSequenceClassification.from_pretrained(
            folder, local_files_only=True, trust_remote_code=False, use_safetensors=True,
            dtype=getattr(torch, self.dtype)).to(self.device).eval()
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        tokenizer.truncation_side = "left"
        num_labels = model.config.num_labels
        if self.label is None:
            if num_labels != 1:
                raise ValueError(f"reward model {folder} has {num_labels} labels "
                                 f"({model.config.id2label}); give label= (an index or a name)")
            index = 0
        elif isinstance(self.label, str):
            label2id = {name: int(i) for i, name in (model.config.id2label or {}).items()}
            if self.label not in label2id:
                raise ValueError(f"reward model {folder}: no label {self.label!r} in {sorted(label2id)}")
            index = label2id[self.label]
        else:
            if not 0 <= self.label < num_labels:
                raise ValueError(f"reward model {folder}: label index {self.label} not in 0..{num_labels - 1}")
            index = int(self.label)
        self._loaded = (tokenizer, model, index)
        return self._loaded

    def _text(self, tokenizer, prompt, completion) -> str:
        if isinstance(prompt, str):
            return prompt + completion_text(completion)
        messages = list(prompt) + [{"role": "assistant", "content": completion_text(completion)}]
        if tokenizer.chat_template:
            return tokenizer.apply_chat_template(messages, tokenize=False)
        return "\n".join(m["content"] for m in messages)

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        import torch

        tokenizer, model, index = self._load()
        texts = [self._text(tokenizer, p, c) for p, c in zip(prompts, completions)]
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        scores = [0.0] * len(texts)
        with torch.inference_mode():
            for start in range(0, len(order), self.batch_size):
                batch = order[start : start + self.batch_size]
                encoded = tokenizer([texts[i] for i in batch], padding=True, return_tensors="pt",
                                    truncation=self.max_length is not None, max_length=self.max_length,
                                    add_special_tokens=True).to(self.device)
                encoded.pop("token_type_ids", None)
                logits = model(**encoded).logits[:, index].float().tolist()
                for i, value in zip(batch, logits):
                    scores[i] = value
        return scores
