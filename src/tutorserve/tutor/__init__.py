"""The tutoring layer: learner model, courses, the turn pipeline (being built; see issue 7)."""
