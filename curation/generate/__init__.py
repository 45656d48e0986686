"""Sampling groups: a `Generator` (vLLM or transformers) turns prompts into G responses each.

    base.py     SamplingConfig, GeneratorConfig (the settings, written once), the Generator
                protocol, load_prompts, prompt_id_of, prompt_seed
    stage.py    the generate stage (prompts file + policy -> samples, rejects, prompts) and
                make_generator(backend, model, **kwargs)
    vllm.py     VLLMGenerator (backend "vllm")
    hf.py       HFGenerator (backend "hf")
"""
