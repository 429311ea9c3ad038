"""Autoscaling without Ray: the policy (``policy``), the engines' performance profile
(``profile``), request traces (``traces``) and a discrete-event cluster simulator
(``simulator``) that judges a policy on a trace. The actuator that applies decisions
to a running cluster lives beside the controller and imports this package, never
the other way round."""
