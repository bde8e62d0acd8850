//! The control communicator: short records the ranks send each other beside the store's
//! collectives, to say where they are and that they exit.
//!
//! - **"Where are you?"** ([`TAG_WHERE`]): a rank whose wait timed out, or that logs a long
//!   wait, asks every other rank. A rank waiting in a kvstore call or at its exit answers
//!   ([`TAG_HERE`]) with its call number and what it waits for; a rank busy outside kvstore
//!   answers at its next wait.
//! - **"I am exiting"** ([`TAG_EXIT`]): every rank sends one to every other rank at its exit:
//!   after which call, and whether it failed. A rank waiting in a call that the exited rank
//!   will never make stops waiting at once.
//!
//! Every record is [`REPORT_BYTES`] long and sent without waiting (`MPI_Isend`) from a buffer
//! kept in the state's outbox until the send completes. Records are read with `MPI_Iprobe`
//! between the tests of a wait, at most every [`poll::SLEEP_MAX`](super::poll::SLEEP_MAX), so a
//! call that completes at once never reads the control communicator.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::os::raw::c_int;
use std::time::{Duration, Instant};

use bytemuck::Zeroable as _;
use mpi::ffi;

use super::raw::{self, Request};
use super::{is_are, State, World};
use crate::comm::fingerprint;
use crate::Key;
use smallvec::SmallVec;

/// Where this rank is, for its answers: its last call's number, the call (op and keys) while
/// in one, and where in it or between calls. Put in words only when a rank asks or a wait is
/// logged, never on a call's way.
pub(super) struct Here {
    pub(super) seq: u64,
    call: Option<(&'static str, SmallVec<[Key; 2]>)>,
    /// Where in the call ("in its broadcast from rank 0"), or where between calls.
    at: Cow<'static, str>,
}

impl Here {
    /// Outside any call (`at`: "between calls", "at its exit").
    pub(super) fn idle(seq: u64, at: &'static str) -> Here {
        Here {
            seq,
            call: None,
            at: Cow::Borrowed(at),
        }
    }

    /// In call `seq`, of `op` with `keys`.
    pub(super) fn in_call<'k>(
        seq: u64,
        op: &'static str,
        keys: impl Iterator<Item = &'k Key>,
    ) -> Here {
        Here {
            seq,
            call: Some((op, keys.cloned().collect())),
            at: Cow::Borrowed(""),
        }
    }

    /// Sets where in the call this rank is.
    pub(super) fn set_at(&mut self, at: String) {
        self.at = Cow::Owned(at);
    }

    /// The call's keys (none outside a call).
    pub(super) fn keys(&self) -> &[Key] {
        self.call.as_ref().map_or(&[], |(_, keys)| keys)
    }

    /// The call in words: "push of key 3" (outside a call, where this rank is).
    pub(super) fn summary(&self) -> String {
        match &self.call {
            Some((op, keys)) => fingerprint::summary_of(op, keys.iter()),
            None => self.at.to_string(),
        }
    }

    /// Where this rank is ("push of key 3, in its reduce to rank 0"), as the record that asks
    /// or answers question `query`.
    pub(super) fn report(&self, query: u32) -> Report {
        let text = match (&self.call, self.at.is_empty()) {
            (Some(_), false) => format!("{}, {}", self.summary(), self.at),
            _ => self.summary(),
        };
        Report {
            seq: self.seq,
            query,
            text,
            ..Report::default()
        }
    }
}

/// "Where are you?", with where the asker is.
pub(super) const TAG_WHERE: c_int = 1;
/// "Here I am": the answer to [`TAG_WHERE`], carrying the question's number.
pub(super) const TAG_HERE: c_int = 2;
/// "I am exiting": sent by every rank to every other rank at its exit.
pub(super) const TAG_EXIT: c_int = 3;
/// Bytes of one control record.
pub(super) const REPORT_BYTES: usize = 256;

/// One control record as it travels: [`REPORT_BYTES`] bytes, integers little-endian, no padding.
#[repr(C)]
#[derive(Clone, Copy, bytemuck::Pod, bytemuck::Zeroable)]
struct Wire {
    seq: u64,
    /// 0 or 1, as `failed`.
    timed_out: u8,
    failed: u8,
    /// How many bytes of `text` are used.
    text_len: u16,
    query: u32,
    /// `u32::MAX` for none.
    cause: u32,
    unused: [u8; 4],
    /// UTF-8, cut at a character boundary to fit.
    text: [u8; REPORT_BYTES - 24],
}

const _: () = {
    use std::mem::{offset_of, size_of};
    assert!(size_of::<Wire>() == REPORT_BYTES);
    assert!(offset_of!(Wire, timed_out) == 8);
    assert!(offset_of!(Wire, failed) == 9);
    assert!(offset_of!(Wire, text_len) == 10);
    assert!(offset_of!(Wire, query) == 12);
    assert!(offset_of!(Wire, cause) == 16);
    assert!(offset_of!(Wire, text) == 24);
};

/// What a silent rank is probably doing.
const SILENT_WHY: &str = "busy outside kvstore: computing, loading data or writing files; or \
                          inside a blocking transfer of kvstore's, which cannot answer; or hung, \
                          or dead";

/// One control record: what a rank says about itself.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Report {
    /// The sender's call number: the call it is in, or the last one it began.
    pub(super) seq: u64,
    /// The sender timed out in that call.
    pub(super) timed_out: bool,
    /// (An exit record.) The sender panicked, exited non-zero, or its world had failed.
    pub(super) failed: bool,
    /// The number of the question a [`TAG_WHERE`] asks and its [`TAG_HERE`] answers.
    pub(super) query: u32,
    /// (An exit record.) The rank whose exit made the sender fail; `text` relays that exit.
    pub(super) cause: Option<usize>,
    /// Where the sender is, or how it exited, in words.
    pub(super) text: String,
}

impl Report {
    /// The record's bytes, as sent (see [`Wire`]).
    pub(super) fn encode(&self) -> [u8; REPORT_BYTES] {
        let mut wire = Wire::zeroed();
        let n = cut(&self.text, wire.text.len()).len();
        wire.text[..n].copy_from_slice(&self.text.as_bytes()[..n]);
        wire.seq = self.seq.to_le();
        wire.timed_out = u8::from(self.timed_out);
        wire.failed = u8::from(self.failed);
        wire.text_len = (n as u16).to_le();
        wire.query = self.query.to_le();
        let cause = self.cause.and_then(|c| u32::try_from(c).ok());
        wire.cause = cause.unwrap_or(u32::MAX).to_le();
        bytemuck::cast(wire)
    }

    /// The report a record's bytes carry, with its text cut to the record and read lossily.
    pub(super) fn decode(b: &[u8; REPORT_BYTES]) -> Report {
        let wire: Wire = bytemuck::cast(*b);
        let n = usize::from(u16::from_le(wire.text_len)).min(wire.text.len());
        Report {
            seq: u64::from_le(wire.seq),
            timed_out: wire.timed_out != 0,
            failed: wire.failed != 0,
            query: u32::from_le(wire.query),
            cause: match u32::from_le(wire.cause) {
                u32::MAX => None,
                c => Some(c as usize),
            },
            text: String::from_utf8_lossy(&wire.text[..n]).into_owned(),
        }
    }
}

impl State {
    /// A fresh question number (never 0).
    pub(super) fn new_query(&mut self) -> u32 {
        self.next_query = self.next_query.wrapping_add(1).max(1);
        self.next_query
    }

    /// Sends `report` with `tag` to every other rank.
    pub(super) fn send_all(&mut self, world: &World, tag: c_int, report: &Report) {
        for r in (0..world.size).filter(|&r| r != world.rank) {
            self.send_report(world, r, tag, report);
        }
    }

    /// Tells every other rank that this one exits ([`TAG_EXIT`]), and how.
    pub(super) fn tell_exit(
        &mut self,
        world: &World,
        failed: bool,
        cause: Option<usize>,
        text: &str,
    ) {
        let report = Report {
            seq: self.seq,
            failed,
            cause,
            text: text.to_owned(),
            ..Report::default()
        };
        self.send_all(world, TAG_EXIT, &report);
    }

    /// What a wait does between its tests: answers other ranks' questions, hears their exits.
    pub(super) fn service(&mut self, world: &World) {
        self.answer_queries(world);
        self.hear_exits();
    }

    /// Answers every pending "where are you?", keeping those of ranks that timed out.
    pub(super) fn answer_queries(&mut self, world: &World) {
        while let Some((src, question)) = self.receive(TAG_WHERE) {
            let answer = self.here.report(question.query);
            if question.timed_out {
                self.heard.insert(src, question);
            }
            self.send_report(world, src, TAG_HERE, &answer);
        }
    }

    /// Records every exit record that has arrived.
    pub(super) fn hear_exits(&mut self) {
        while let Some((src, report)) = self.receive(TAG_EXIT) {
            self.exits.insert(src, report);
        }
    }

    /// A rank that exited without making call `seq` (its last call is earlier), with its exit
    /// record. One that failed in or after call `seq` is not: its part may be done, and its
    /// `MPI_Abort` ends the job soon anyway.
    pub(super) fn gone(&self, seq: u64) -> Option<(usize, &Report)> {
        self.first_exit(|rep| rep.seq < seq)
    }

    /// A rank whose exit record says that it failed.
    pub(super) fn failed(&self) -> Option<(usize, &Report)> {
        self.first_exit(|rep| rep.failed)
    }

    /// The first exit record that `pick`s (unrelayed ones first) and the rank that exited first.
    fn first_exit(&self, pick: impl Fn(&Report) -> bool) -> Option<(usize, &Report)> {
        let first = |relayed: bool| {
            self.exits
                .iter()
                .filter(|(_, rep)| rep.cause.is_some() == relayed && pick(rep))
                .map(|(&r, rep)| (rep.cause.unwrap_or(r), rep))
                .next()
        };
        first(false).or_else(|| first(true))
    }

    /// Receives one waiting control message with `tag`, if there is one.
    pub(super) fn receive(&mut self, tag: c_int) -> Option<(usize, Report)> {
        let mut flag: c_int = 0;
        let mut buf = [0u8; REPORT_BYTES];
        let (bytes, dt, comm) = (REPORT_BYTES as c_int, raw::datatype::<u8>(), self.control.0);
        // SAFETY: an all-zero MPI_Status is a valid value of this plain C struct; MPI overwrites
        // it.
        let mut status: ffi::MPI_Status = unsafe { std::mem::zeroed() };
        // SAFETY: the control communicator is valid; `flag` and `status` are valid out-pointers;
        // the receive only runs when a matching message is already there, so it does not block,
        // and `buf` holds REPORT_BYTES bytes, the size of every control record.
        unsafe {
            let rc = ffi::MPI_Iprobe(ffi::RSMPI_ANY_SOURCE, tag, comm, &mut flag, &mut status);
            if rc != ffi::MPI_SUCCESS as c_int || flag == 0 {
                return None;
            }
            let (src, ignore) = (status.MPI_SOURCE, ffi::RSMPI_STATUS_IGNORE);
            let rc = ffi::MPI_Recv(buf.as_mut_ptr().cast(), bytes, dt, src, tag, comm, ignore);
            if rc != ffi::MPI_SUCCESS as c_int {
                return None;
            }
            Some((src as usize, Report::decode(&buf)))
        }
    }

    /// Forgets the sends of the outbox that have completed; returns whether it is empty.
    pub(super) fn flush_outbox(&mut self) -> bool {
        let mut outbox = std::mem::take(&mut self.outbox);
        outbox.retain_mut(|(req, _)| {
            !matches!(
                self.test(std::slice::from_mut(req), None, "report"),
                Ok(true)
            )
        });
        self.outbox = outbox;
        self.outbox.is_empty()
    }

    /// Sends a control record to `dest` without waiting; the buffer is kept in the outbox.
    pub(super) fn send_report(&mut self, world: &World, dest: usize, tag: c_int, report: &Report) {
        self.flush_outbox();
        let buf = Box::new(report.encode());
        let mut req = Request::null();
        let (bytes, dt, comm) = (REPORT_BYTES as c_int, raw::datatype::<u8>(), self.control.0);
        let (ptr, to) = (buf.as_ptr().cast(), dest as c_int);
        // SAFETY: `buf` is a heap buffer of REPORT_BYTES bytes that stays in the outbox (and is
        // never freed while the send may be pending: an unfinished entry is only dropped when
        // the process ends); the control communicator and `dest` (< size) are valid.
        let rc = unsafe { ffi::MPI_Isend(ptr, bytes, dt, to, tag, comm, &mut req.0) };
        if rc == ffi::MPI_SUCCESS as c_int {
            self.outbox.push((req, buf));
        } else {
            say(&format!(
                "kvstore: rank {}: could not send a control record to rank {dest}: {}",
                world.rank,
                raw::error_string(rc)
            ));
        }
    }
}

/// The "still waiting" log of one wait: asks the others where they are every [`World::wait_log`].
pub(super) struct Watch {
    every: Duration,
    next: Instant,
    /// The question out now, and when it was asked.
    asked: Option<(u32, Instant)>,
    answers: BTreeMap<usize, Report>,
}

impl Watch {
    /// The log of a wait that began at `start`.
    pub(super) fn new(world: &World, start: Instant) -> Watch {
        Watch {
            every: world.wait_log,
            next: start + world.wait_log,
            asked: None,
            answers: BTreeMap::new(),
        }
    }

    /// Asks when it is time; returns the answers (by rank) once a round is complete. No wait.
    pub(super) fn tick(
        &mut self,
        st: &mut State,
        world: &World,
    ) -> Option<BTreeMap<usize, Report>> {
        let now = Instant::now();
        match self.asked {
            None if now >= self.next => {
                let query = st.new_query();
                let question = st.here.report(query);
                st.send_all(world, TAG_WHERE, &question);
                self.asked = Some((query, now));
                self.answers.clear();
                None
            }
            None => None,
            Some((query, asked)) => {
                // Answers to older questions are stale: drop them.
                while let Some((src, answer)) = st.receive(TAG_HERE) {
                    if answer.query == query {
                        self.answers.insert(src, answer);
                    }
                }
                let window = (self.every / 2).min(Duration::from_secs(1));
                if self.answers.len() + 1 < world.size && now < asked + window {
                    return None;
                }
                self.asked = None;
                self.next = asked + self.every;
                Some(std::mem::take(&mut self.answers))
            }
        }
    }
}

/// Where the other ranks are, as a rank in call `seq` sees it from their reports.
#[derive(Default)]
pub(super) struct Whereabouts {
    /// The ranks that are not in this call: silent, or at another call.
    pub(super) missing: Vec<usize>,
    /// The ranks that did not answer.
    pub(super) silent: Vec<usize>,
    /// "rank 2 is at call #18 (pull of key 5)", for each rank at another call.
    pub(super) elsewhere: Vec<String>,
    /// The ranks waiting in this same call.
    pub(super) same: Vec<usize>,
}

impl Whereabouts {
    /// Sorts the ranks other than `me` (of `size`) by their `reports`, for a rank in call `seq`.
    pub(super) fn of(
        seq: u64,
        (me, size): (usize, usize),
        reports: &BTreeMap<usize, Report>,
    ) -> Whereabouts {
        let mut w = Whereabouts::default();
        for r in (0..size).filter(|&r| r != me) {
            match reports.get(&r) {
                None => {
                    w.missing.push(r);
                    w.silent.push(r);
                }
                Some(rep) if rep.seq == seq => w.same.push(r),
                Some(rep) => {
                    w.missing.push(r);
                    let timed_out = rep.timed_out.then_some(" and timed out there");
                    w.elsewhere.push(format!(
                        "rank {r} is at call #{} ({}){}",
                        rep.seq,
                        rep.text,
                        timed_out.unwrap_or_default()
                    ));
                }
            }
        }
        w
    }

    /// The sentences of a message: who is silent (and `why`), who is elsewhere, who is here.
    pub(super) fn parts(&self, why: &str) -> Vec<String> {
        let mut parts: Vec<String> = silent(&self.silent, why).into_iter().collect();
        parts.extend(self.elsewhere.iter().cloned());
        if !self.same.is_empty() {
            parts.push(format!(
                "{} {} waiting in this same call",
                fingerprint::ranks(&self.same),
                is_are(&self.same)
            ));
        }
        parts
    }
}

/// "ranks 1, 3 are not responding (`why`)", unless `ranks` is empty.
fn silent(ranks: &[usize], why: &str) -> Option<String> {
    let (list, verb) = (fingerprint::ranks(ranks), is_are(ranks));
    (!ranks.is_empty()).then(|| format!("{list} {verb} not responding ({why})"))
}

/// The log line of a rank that has waited `waited` in call `seq` (`summary`, e.g. "push of key
/// 7"), in its `what`, given the other ranks' answers and their `hosts`.
pub(super) fn wait_line(
    (me, size, hosts): (usize, usize, &[String]),
    seq: u64,
    summary: &str,
    what: &str,
    waited: Duration,
    answers: &BTreeMap<usize, Report>,
    timeout: Duration,
) -> String {
    let w = Whereabouts::of(seq, (me, size), answers);
    let whom = if w.missing.is_empty() {
        String::new()
    } else {
        format!(" for {}", super::hosts::ranks_on_hosts(&w.missing, hosts))
    };
    let mut parts = w.parts(SILENT_WHY);
    if w.missing.is_empty() {
        parts.push(
            "every rank is in this call, so the transfer itself is slow, or the ranks' \
             collectives do not match"
                .to_owned(),
        );
    }
    format!(
        "kvstore: rank {me}: waiting{whom} for {} s now, in call #{seq} ({summary}), in its \
         {what}: {}. The call fails after KVSTORE_TIMEOUT={} s",
        waited.as_secs(),
        parts.join("; "),
        timeout.as_secs_f64()
    )
}

/// The log line of a rank at its exit after call `seq`, waiting for the `awaited` ranks.
pub(super) fn exit_line(
    me: usize,
    seq: u64,
    awaited: &[usize],
    waited: Duration,
    answers: &BTreeMap<usize, Report>,
) -> String {
    let (mut quiet, mut parts) = (Vec::new(), Vec::new());
    for &r in awaited {
        match answers.get(&r) {
            Some(rep) => parts.push(format!("rank {r} is at call #{} ({})", rep.seq, rep.text)),
            None => quiet.push(r),
        }
    }
    if let Some(silent) = silent(&quiet, SILENT_WHY) {
        parts.insert(0, silent);
    }
    format!(
        "kvstore: rank {me}: at its exit after call #{seq}, waiting for {} for {} s now: {}. \
         A normal exit waits for every rank to reach its own exit, with no time limit; a rank \
         that fails ends the job",
        fingerprint::ranks(awaited),
        waited.as_secs(),
        parts.join("; ")
    )
}

/// Logs `msg` as a warning through `log` when a logger takes warnings, else on stderr: a rank
/// that waits must be heard without a logger.
pub(super) fn warn(msg: &str) {
    if log::log_enabled!(log::Level::Warn) {
        log::warn!("{msg}");
    } else {
        say(msg);
    }
}

/// Writes `msg` and a newline to stderr in one `write`, so that the lines of ranks that share
/// `mpirun`'s stderr do not interleave (`eprintln!` may write a line in pieces).
pub(super) fn say(msg: &str) {
    let line = format!("{msg}\n");
    let _ = std::io::Write::write_all(&mut std::io::stderr().lock(), line.as_bytes());
}

/// The longest start of `text` of at most `max` bytes that ends at a character boundary.
pub(super) fn cut(text: &str, max: usize) -> &str {
    let mut n = text.len().min(max);
    while !text.is_char_boundary(n) {
        n -= 1;
    }
    &text[..n]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(seq: u64, text: &str) -> Report {
        Report {
            seq,
            text: text.to_owned(),
            ..Report::default()
        }
    }

    #[test]
    fn a_report_survives_its_encoding() {
        let r = Report {
            seq: 18,
            timed_out: true,
            failed: true,
            query: 0xdead_beef,
            cause: Some(3),
            text: "pull of key 5".to_owned(),
        };
        assert_eq!(Report::decode(&r.encode()), r);
        let none = report(2, "x");
        assert_eq!(Report::decode(&none.encode()).cause, None);
        let long = "é".repeat(200);
        let r = Report::decode(&report(1, &long).encode());
        assert!(long.starts_with(&r.text) && !r.text.is_empty());
    }

    #[test]
    fn a_record_keeps_its_wire_layout() {
        let r = Report {
            seq: 0x0102_0304_0506_0708,
            timed_out: true,
            failed: false,
            query: 0xdead_beef,
            cause: Some(5),
            text: "push of key 9".to_owned(),
        };
        let b = r.encode();
        // The layout written out by hand: seq, the two flags, the text's length, the query,
        // the cause, 4 unused bytes, then the text; little-endian; the rest zero.
        let mut want = [0u8; REPORT_BYTES];
        want[..8].copy_from_slice(&0x0102_0304_0506_0708u64.to_le_bytes());
        want[8] = 1;
        want[10..12].copy_from_slice(&13u16.to_le_bytes());
        want[12..16].copy_from_slice(&0xdead_beefu32.to_le_bytes());
        want[16..20].copy_from_slice(&5u32.to_le_bytes());
        want[24..37].copy_from_slice(b"push of key 9");
        assert_eq!(b, want);
        assert_eq!(Report::decode(&want), r);
        // A text length past the record is cut to it, not read past its end.
        let mut long = want;
        long[10..12].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(Report::decode(&long).text.len(), REPORT_BYTES - 24);
    }

    #[test]
    fn a_wait_line_names_the_awaited_ranks_and_the_call() {
        let mut answers = BTreeMap::new();
        answers.insert(2, report(7, "push of key 7, in its reduce to rank 0"));
        answers.insert(3, report(5, "pull of key 1"));
        let hosts = ["a", "b", "c", "d"].map(String::from);
        let line = wait_line(
            (0, 4, &hosts),
            7,
            "push of key 7",
            "reduce to rank 0",
            Duration::from_secs(60),
            &answers,
            Duration::from_secs(1800),
        );
        for part in [
            "kvstore: rank 0: waiting for ranks 1, 3 (hosts b, d) for 60 s now, in call #7 (push \
             of key 7), \
             in its reduce to rank 0: ",
            "rank 1 is not responding (busy outside kvstore",
            "rank 3 is at call #5 (pull of key 1)",
            "rank 2 is waiting in this same call",
            "KVSTORE_TIMEOUT=1800 s",
        ] {
            assert!(line.contains(part), "'{part}' not in: {line}");
        }
        let all_here: BTreeMap<usize, Report> = [(1, report(7, "x"))].into_iter().collect();
        let line = wait_line(
            (0, 2, &hosts),
            7,
            "p",
            "w",
            Duration::ZERO,
            &all_here,
            Duration::ZERO,
        );
        assert!(line.contains("waiting for 0 s now"), "{line}");
        assert!(line.contains("every rank is in this call"), "{line}");
    }

    #[test]
    fn an_exit_line_names_the_ranks_not_at_their_exit() {
        let answers: BTreeMap<usize, Report> =
            [(2, report(9, "pull of key 4"))].into_iter().collect();
        let line = exit_line(1, 8, &[0, 2], Duration::from_secs(120), &answers);
        for part in [
            "kvstore: rank 1: at its exit after call #8, waiting for ranks [0, 2] for 120 s now: ",
            "rank 0 is not responding",
            "rank 2 is at call #9 (pull of key 4)",
            "no time limit",
        ] {
            assert!(line.contains(part), "'{part}' not in: {line}");
        }
    }
}
