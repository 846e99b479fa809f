"""A run's plan before it starts (forecast): the parameters it will remove, its phases' time, its peak
memory and the pruned model's size, from the probe's measured rate. The plan a started run keeps beside what it
measured is engine/run/plan.py."""
