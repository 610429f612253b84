"""te_lab inside other libraries' training loops: :class:`~te_lab.integrations.trainer.TrainerCallback`
for Hugging Face's ``Trainer`` (and TRL's trainers, which are Trainers). Each module imports
its library when it is imported itself, never from ``import te_lab``."""
