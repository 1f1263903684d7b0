"""Run planning without weights: memory estimates per rank (`plan.memory`) and the `--check` of
launch/pretrain_vlm.py (`plan.check`): resolve a config, build the model on the meta device, check
sizes and divisibility, and compare the estimated peak memory per rank with the device's."""
