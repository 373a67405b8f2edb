"""Planning: the program of every tensor of a model, decided and checked before anything is allocated.

The planner (``plan``), the model's own init code run on stand-ins (``init_code``), the checks of a
finished plan (``plan_checks``; ``shared_draws``, the pipeline-cut warning), what planning decides
(``planned``: ``PlannedTensor``, ``ModelPlan``) and the options it reads (``options``: ``InitOptions``).
"""
