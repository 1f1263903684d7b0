"""PPO's critic (`[rl] advantage = "gae"`, `[rl.critic]`): a value head on a backbone, its per-token values, the
token rewards and GAE advantages built from them, and its own updates, optimizer and checkpoint state.

    value_model.py  `ValueModel`: backbone + scalar Linear head, values at the policy's log-prob positions
    build.py        `build_critic(ctx, bundle, rl, num_steps)`: load the backbone ("policy" or a folder), checks
    rewards.py      per-token rewards (the sequence reward on the last token, the KL penalty per token)
    ppo_critic.py   `Critic`: values of a step's samples, their advantages / returns, the critic updates

Import the submodules directly; this file imports none of them.
"""
