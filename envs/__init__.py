"""Environments: what an agent does and how it is scored (installed as `astratk.envs`).

Each env subclasses `astratk.contracts.Env`. Add one by writing a module here (or anywhere importable) and naming it in
a config by dotted path, or by a short name added to `astratk.registry.REGISTRY["env"]`.
"""
