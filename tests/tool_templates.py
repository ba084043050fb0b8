"""Chat templates that render tools, shortened from each family's own (what their calls, results and tool lists
look like in the prompt), for tests of the tool-call formats without downloading a model."""

# Mistral v0.3 / Ministral: tools before the last user turn, calls as a JSON list with 9-character ids (the
# template refuses others), results as [TOOL_RESULTS] blocks
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message.role == 'user' %}"
    "{% if tools and loop.last %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {{ message.content }}[/INST]"
    "{% elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS] ["
    "{% for tool_call in message.tool_calls %}{% set out = tool_call.function | tojson %}{{ out[:-1] }}"
    "{% if not tool_call.id is defined or tool_call.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
    ", \"id\": \"{{ tool_call.id }}\"}{% if not loop.last %}, {% else %}]{{ eos_token }}{% endif %}{% endfor %}"
    "{% elif message.role == 'assistant' %} {{ message.content }}{{ eos_token }}"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS] {\"content\": {{ message.content }}, "
    "\"call_id\": \"{{ message.tool_call_id }}\"}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}")

# Llama 3.1 / 3.2 with JSON tool calls: "Environment: ipython", one call of {"name", "parameters"}, results in an
# ipython turn
LLAMA3_JSON = (
    "{{ bos_token }}<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}Environment: ipython\n{% endif %}Cutting Knowledge Date: December 2023\n<|eot_id|>"
    "{% for message in messages %}"
    "{% if message.role == 'user' and loop.last and tools %}<|start_header_id|>user<|end_header_id|>\n\n"
    "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
    "best answers the given prompt.\n\nRespond in the format {\"name\": function name, \"parameters\": dictionary "
    "of argument name and its value}. Do not use variables.\n\n"
    "{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}{{ message.content }}<|eot_id|>"
    "{% elif message.tool_calls %}"
    "{% if message.tool_calls | length != 1 %}{{ raise_exception('This model only supports single tool-calls at "
    "once!') }}{% endif %}{% set tool_call = message.tool_calls[0].function %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{{ '{\"name\": \"' + tool_call.name + '\", ' }}{{ '\"parameters\": ' }}{{ tool_call.arguments | tojson }}"
    "{{ \"}\" }}<|eot_id|>"
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

# Qwen2.5 (Hermes's calls): tools in the system turn, calls in <tool_call> blocks, results as <tool_response>
HERMES = (
    "{% if tools %}<|im_start|>system\nYou are Qwen.\n\n# Tools\n\nYou are provided with function signatures within "
    "<tools></tools> XML tags:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% for tool_call in message.tool_calls %}<tool_call>\n{\"name\": \"{{ tool_call.function.name }}\", "
    "\"arguments\": {{ tool_call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TEMPLATES = {"mistral": MISTRAL, "llama3_json": LLAMA3_JSON, "hermes": HERMES}
