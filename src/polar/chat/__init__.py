"""A model's chat format, both ways: rendering messages with its template, and reading its answers back
(reasoning split from content, tool calls parsed with the model's parser).

Shared by the embedded engine (which serves chat like vLLM) and the gateway (which renders itself when it
sends token ids: `polar.gateway.render`). Nothing here imports torch; `render` needs a tokenizer object.
"""
