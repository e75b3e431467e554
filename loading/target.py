"""mlx-lm's loader for a target whose checkpoint also holds MTP layers (mtp/model.py reads
those)."""

from pathlib import Path


def load_mlx_lm(path: Path, lazy: bool = False) -> tuple:
    """mlx-lm's ``load`` of a local directory, returning ``(model, tokenizer, config)``, with the
    checkpoint's MTP weights left out of the target: mlx-lm's ``sanitize`` drops them only where it
    knows their place (DeepSeek-V3's at layer 61 alone). mtp/model.py reads them itself."""
    from mlx_lm.utils import _get_classes, load_tokenizer
    from mlx_lm.utils import load_model as load_mlx_model

    from mtp.model import NoMTPWeights, mtp_prefix

    def classes(config: dict):
        model_class, args_class = _get_classes(config)
        try:
            prefix = mtp_prefix(config)
        except NoMTPWeights:
            return model_class, args_class

        def sanitize(self, weights):
            return model_class.sanitize(
                self, {k: v for k, v in weights.items() if not k.startswith(prefix)}
            )

        return type(model_class.__name__, (model_class,), {"sanitize": sanitize}), args_class

    model, config = load_mlx_model(Path(path), lazy, get_model_classes=classes)
    tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer, config
