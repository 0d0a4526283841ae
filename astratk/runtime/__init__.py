"""Runtime: clusters, deployment of the data layer and acquisition, evaluation, and the `Run` handle."""
