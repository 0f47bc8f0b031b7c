"""The tutor: courses, the learner model, the Socratic ladder, the turn's agent graph and the
service that runs sessions and turns over a store and one chat model."""
