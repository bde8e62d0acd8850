//! Where the survivors of a lost rank agree, call by call, on a link that goes on after a loss
//! (MPI with fault tolerance, and the loopback link that models it).
//!
//! A rank can be lost at any moment of a call, and a collective it was in may then complete on
//! some survivors and fail on others. So that every survivor ends each call the same way, a
//! call passes fault-tolerant agreements, its *points*, which every survivor reaches:
//!
//! - the **commit point** of a call that changes the store (a push, pushpull, init, load or
//!   heal): every survivor applies the change, or none does;
//! - the **end point** of a call that goes on after its commit point (a pushpull's pull, or a
//!   push that sends its updated parts to the buddies: `KVSTORE_REPLICA_UPDATE=send`) or
//!   never commits (a pull, barrier, save, `agree` or `any_of`): every survivor returns from it
//!   `Ok`, or every survivor fails it, so that a loss costs the same call everywhere.
//!
//! A rank that succeeds passes each point in turn, voting [`Vote::Yes`]. A rank whose own part
//! failed votes [`Vote::FailedHere`] at the next point, and every rank fails the call, with no
//! rank lost. A rank that failed because a rank was lost passes the points it has not, voting
//! [`Vote::Recovering`], on its way to recovery ([`Points::next`]). After an agreement that
//! did not pass, a call has no further point: every survivor has failed it.

/// How a call's points go: which it has, and which it has passed, with what outcome.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Points {
    /// Whether the call has a commit point, and its outcome once passed.
    commits: bool,
    commit: Option<Agreed>,
    /// Whether the call has an end point, and its outcome once passed.
    ends: bool,
    end: Option<Agreed>,
}

/// A point of a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Point {
    Commit,
    End,
}

/// What a rank brings to an agreement.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Vote {
    /// Its part of the call succeeded.
    Yes,
    /// Its own part failed (not for a lost rank).
    FailedHere,
    /// It failed because a rank was lost, and is on its way to recovery.
    Recovering,
}

/// What an agreement found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Agreed {
    /// Every rank voted [`Vote::Yes`].
    All,
    /// A rank's own part failed, and no rank was lost.
    FailedElsewhere,
    /// A rank was lost.
    Lost,
}

impl Vote {
    /// The vote as the flag an agreement ANDs across ranks: bit 0, the part succeeded; bit 1,
    /// no rank is recovering from a loss.
    pub(crate) fn flag(self) -> i32 {
        match self {
            Vote::Yes => 0b11,
            Vote::FailedHere => 0b10,
            Vote::Recovering => 0b00,
        }
    }
}

impl From<bool> for Vote {
    /// A rank's part succeeded (`true`), or failed here.
    fn from(ok: bool) -> Vote {
        match ok {
            true => Vote::Yes,
            false => Vote::FailedHere,
        }
    }
}

impl Agreed {
    /// What an agreement found from the AND of every rank's [`Vote::flag`] (`None`: the
    /// agreement itself failed, which only a loss does).
    pub(crate) fn from_flag(anded: Option<i32>) -> Agreed {
        match anded {
            Some(f) if f & 0b11 == 0b11 => Agreed::All,
            Some(f) if f & 0b10 == 0b10 => Agreed::FailedElsewhere,
            _ => Agreed::Lost,
        }
    }
}

impl Points {
    /// The points of a call of `op` (a fingerprint's), on a link that goes on after a loss.
    pub(crate) fn of(op: &str) -> Points {
        Points {
            commits: matches!(op, "push" | "pushpull" | "init" | "load" | "heal"),
            commit: None,
            ends: matches!(
                op,
                "pull" | "pushpull" | "barrier" | "save" | "agree" | "any_of"
            ),
            end: None,
        }
    }

    /// The points of call `fp`: its op's, and an end point where it asks for one.
    pub(crate) fn of_call(fp: &super::fingerprint::Fingerprint) -> Points {
        let mut points = Points::of(fp.op());
        points.ends |= fp.has_end_point();
        points
    }

    /// The next point the call has to pass, if any: none after an agreement that did not pass
    /// (every survivor has failed the call then). A rank that failed the call for a lost rank
    /// passes it voting [`Vote::Recovering`] on its way to recovery.
    pub(crate) fn next(&self) -> Option<Point> {
        let failed = |a: Option<Agreed>| a.is_some_and(|a| a != Agreed::All);
        if failed(self.commit) || failed(self.end) {
            return None;
        }
        if self.commits && self.commit.is_none() {
            return Some(Point::Commit);
        }
        if self.ends && self.end.is_none() {
            return Some(Point::End);
        }
        None
    }

    /// Records the outcome of the call's next point.
    pub(crate) fn passed(&mut self, point: Point, agreed: Agreed) {
        match point {
            Point::Commit => self.commit = Some(agreed),
            Point::End => self.end = Some(agreed),
        }
    }

    /// Whether the call committed on every survivor.
    pub(crate) fn committed(&self) -> bool {
        self.commit == Some(Agreed::All)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn votes_and_a_loss_decide_as_the_and_of_their_flags() {
        let and = |votes: &[Vote]| votes.iter().fold(0b11, |a, v| a & v.flag());
        use Vote::*;
        assert_eq!(Agreed::from_flag(Some(and(&[Yes, Yes]))), Agreed::All);
        let f = Some(and(&[Yes, FailedHere, Yes]));
        assert_eq!(Agreed::from_flag(f), Agreed::FailedElsewhere);
        let f = Some(and(&[FailedHere, Recovering]));
        assert_eq!(Agreed::from_flag(f), Agreed::Lost);
        assert_eq!(Agreed::from_flag(None), Agreed::Lost);
    }

    #[test]
    fn a_pushpull_commits_then_ends_and_a_failed_point_is_the_last() {
        let mut p = Points::of("pushpull");
        assert!(p.next() == Some(Point::Commit) && !p.committed());
        p.passed(Point::Commit, Agreed::All);
        assert!(p.committed() && p.next() == Some(Point::End));
        p.passed(Point::End, Agreed::Lost);
        assert_eq!(p.next(), None);

        let mut p = Points::of("pushpull");
        p.passed(Point::Commit, Agreed::Lost);
        assert_eq!(p.next(), None, "no end point after a failed commit");
        assert!(!p.committed());
    }

    #[test]
    fn each_op_has_its_points() {
        assert_eq!(Points::of("push").next(), Some(Point::Commit));
        assert_eq!(Points::of("pull").next(), Some(Point::End));
        assert_eq!(Points::of("save").next(), Some(Point::End));
        let mut push = Points::of("push");
        push.passed(Point::Commit, Agreed::All);
        assert_eq!(push.next(), None, "a push ends at its commit point");
        assert_eq!(Points::of("create").next(), None);
    }
}
