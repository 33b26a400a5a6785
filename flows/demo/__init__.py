"""``make team-demo`` (:mod:`~flows.demo.team_demo`): the whole team on one machine, then
stopped."""
