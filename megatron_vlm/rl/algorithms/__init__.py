"""RL algorithms registered by name, one registry per family (in the style of verl's `core_algos`, typed).

    family            registry (module)                                  config key
    policy loss       `POLICY_LOSSES` (policy_losses.py)                 [rl] policy_loss
    advantage         `ADVANTAGE_ESTIMATORS` (advantage_estimators.py)   [rl] advantage
    value loss        `VALUE_LOSSES` (value_losses.py)                   [rl.critic] value_loss (advantage = "gae")
    preference loss   `PREFERENCE_LOSSES` (training/dpo/loss_registry.py) [dpo] loss_type (train.mode = "dpo")

Adding an algorithm: write one function with the family's signature (the `Protocol` of its module) in
that module (or any module imported before the config is validated) and decorate it with the family's
`register("name")`; the name is then a valid value of the config key, listed in its errors, and picked
by the one spec object built from the config (`PolicyLossSpec.from_config`, validated once, not per
micro-batch). Each module documents its family's equations; tests/unit/rl/test_algorithm_registry.py
checks the mechanism. Import the submodules directly; this file imports none of them.
"""
