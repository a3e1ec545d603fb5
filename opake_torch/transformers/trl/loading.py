"""A model and tokenizer given by name or path, loaded as TRL's trainers load them.

TRL's ``SFTTrainer(model="Qwen/Qwen2-0.5B", ...)`` builds the model with ``from_pretrained`` and the config's
``model_init_kwargs`` (``revision``, ``dtype``, ``attn_implementation``, ...; ``trust_remote_code`` from the config
when the kwargs do not set it), in the architecture the checkpoint's config names (``AutoModelForCausalLM`` when
``transformers`` has no class of that name), and loads the tokenizer from the same name. The private trainers do
the same, with two differences:

- ``device_map`` defaults to None: the trainer places the model on ``args.device`` itself (TRL's ``"auto"`` could
  spread one model over several devices).
- A ``quantization_config`` (as a trainer argument or in ``model_init_kwargs``) is refused: quantized base weights
  are not among the models the private trainers are tested on. ``quantization_config=None``, what TRL's scripts pass
  without ``--load_in_4bit`` / ``--load_in_8bit``, is accepted.

The model is public input (a pretrained checkpoint), so loading it by name changes nothing in the guarantee.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from opake_core.errors import ConfigurationError

__all__ = ["load_model", "load_tokenizer"]

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_QUANTIZED = (
    "quantized base weights are not supported by the private trainers. Load the model in bfloat16 or float32 (drop "
    "--load_in_4bit / --load_in_8bit); LoRA adapters (peft_config) bound the memory of the trained weights instead"
)


def _dtype(value: Any) -> Any:
    """TRL's ``dtype`` rule: a ``torch.dtype``, ``"auto"`` or None as given; a name of a float type as that type."""
    if value is None or value == "auto" or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in _DTYPES:
        return _DTYPES[value]
    raise ConfigurationError(
        f"model_init_kwargs['dtype'] must be 'auto', one of {list(_DTYPES)} or a torch.dtype, got {value!r}; e.g. "
        "--dtype bfloat16."
    )


def load_model(model: Any, args: Any, quantization_config: Any = None) -> Any:
    """``model`` if it is a model object, else the model at that name or path, loaded with ``args.model_init_kwargs``.

    Args:
        model: an ``nn.Module``, or a Hugging Face model id or local folder.
        args: an :class:`~opake_torch.transformers.trl.SFTConfig` / ``DPOConfig`` (``model_init_kwargs``,
            ``trust_remote_code``).
        quantization_config: TRL's trainer argument; only None is accepted.

    Raises:
        ConfigurationError: a quantization config, a ``dtype`` TRL would refuse too, or ``model`` neither a module
            nor a string.
    """
    if quantization_config is not None:
        raise ConfigurationError(f"quantization_config={quantization_config!r} is refused: {_QUANTIZED}.")
    if isinstance(model, nn.Module):
        if args.model_init_kwargs:
            logger.warning("model_init_kwargs are ignored: the model is already instantiated (as in TRL).")
        return model
    if not isinstance(model, str) or not model:
        raise ConfigurationError(
            f"model must be a model object or the name or path of a pretrained model, got {type(model).__name__}."
        )
    kwargs = dict(args.model_init_kwargs or {})  # a copy: the config's dict is the user's
    if kwargs.get("quantization_config") is not None:
        raise ConfigurationError(f"model_init_kwargs['quantization_config'] is refused: {_QUANTIZED}.")
    kwargs.setdefault("trust_remote_code", args.trust_remote_code)
    kwargs["dtype"] = _dtype(kwargs.get("dtype", "float32"))
    kwargs.setdefault("device_map", None)
    import transformers

    config = transformers.AutoConfig.from_pretrained(model, trust_remote_code=kwargs["trust_remote_code"])
    names = getattr(config, "architectures", None) or []
    architecture = getattr(transformers, names[0], None) if names else None
    if architecture is None:  # remote code, or no architecture recorded: TRL's fallback
        architecture = transformers.AutoModelForCausalLM
    return architecture.from_pretrained(model, **kwargs)


def load_tokenizer(processing_class: Any, model: Any, args: Any) -> Any:
    """``processing_class``; when it is None and ``model`` is a name or path, the tokenizer saved there, as TRL
    loads it (a model object without a tokenizer keeps None: pre-tokenized rows need none)."""
    if processing_class is not None or not isinstance(model, str):
        return processing_class
    import transformers

    revision = (args.model_init_kwargs or {}).get("revision")
    return transformers.AutoTokenizer.from_pretrained(
        model, revision=revision, trust_remote_code=args.trust_remote_code
    )
