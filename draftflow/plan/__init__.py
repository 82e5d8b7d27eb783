"""Before any job runs: what the config asks of the machine.

``target_shape`` reads a target's config.json (layers, heads, KV bytes per token, weight bytes),
``engines`` lists every vLLM engine the run will start with its arguments, devices and memory
estimate, and ``checks`` holds the cross-key checks rules/common.smk runs at start.
``python -m draftflow.plan --configfile FILE --target-config config.json`` prints the plan.
"""
