"""`ServedModel`: chat messages need the tokenizer's chat template."""

from types import SimpleNamespace

import pytest

from ecru.serve.engine.models import ServedModel


@pytest.mark.parametrize("template", [None, ""])
def test_chat_messages_to_a_model_without_a_chat_template_are_refused(template):
    served = ServedModel("raw-lm", object(), SimpleNamespace(chat_template=template))
    with pytest.raises(
        ValueError, match="model raw-lm has no chat template: send a raw prompt to /v1/completions"
    ):
        served.encode_chat([{"role": "user", "content": "hi"}])
