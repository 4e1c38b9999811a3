"""The capacity planner (`inferd plan`): a discrete-event simulation of a day of traffic against workers modelled
from `inferd profile`'s measured step times, driving the autoscaler's own code."""
