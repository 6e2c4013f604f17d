//! MP4 and M4A files (ISO base media: what phones record and Safari's MediaRecorder writes,
//! AAC inside) checked before Symphonia's MP4 reader sees them ([`check`]), and the encoder
//! priming that reader leaves in ([`Track::priming`]).
//!
//! Symphonia 0.5 trusts an MP4 file. It reserves what a sample table's count claims before it
//! reads one entry (an `stsz` claiming 2^32-1 sizes asks the allocator for 16 GiB, and a
//! refused allocation aborts the process: there is no panic to catch); it reads a packet of
//! whatever size the table states; and it finds each packet's time by walking the
//! time-to-sample table from its start, for every track, at every packet. So every box it
//! would read is walked here first, as it reads them (the same boxes under the same parents,
//! sizes read the same way), and the file is refused, naming the box, where:
//! - a box's size is under its header's, or runs past its parent or the file (size 0, "to the
//!   end", only for a top-level `mdat`, `free` or `skip`, which Symphonia does not read);
//! - a table's entries (`stsz`, `stco`, `co64`, `stsc`, `stts`, `elst`, `trun`) do not fit in
//!   the box that holds them, or a packet is said to be larger than the file;
//! - its tracks last longer than the limit, or list more packets than [`PACKETS_PER_SECOND`]
//!   over the limit's seconds (a forged table can list billions of empty packets);
//! - reading them would cost Symphonia more than [`WORK`] steps of its per-packet table walks
//!   (every packet's time is found from its table's first entry, so a table of one entry a
//!   packet costs the square of its packets), or it has more than [`MAX_TRACKS`] tracks (each
//!   track's packets may be read up to the file's length).
//!
//! What Symphonia would read that the decoding does not use (the tags in `udta`, a top-level
//! `meta`, the segment index `sidx`) is renamed `free` in the bytes handed to it, so it skips
//! it: its tag parser is not exposed to a client's file at all.

use super::AudioError;

/// The tracks a file may have: phones write two to four (video, audio, metadata, time code).
const MAX_TRACKS: usize = 64;

/// The packets a second of the limit may hold, over all tracks: AAC at 96 kHz has 94 packets a
/// second, Opus of 20 ms frames 50, video at 240 frames a second 240.
const PACKETS_PER_SECOND: u64 = 400;

/// The steps of Symphonia's per-packet table walks a file may cost: about a second. A recording
/// costs a few per packet (its time-to-sample table has one or two entries): two hours of AAC
/// at 48 kHz, 337,500 packets, cost about a million.
const WORK: u64 = 1 << 31;

/// A track as [`check`] found it; the file's tracks are in the order of their `trak` boxes,
/// which is the order of Symphonia's track ids.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct Track {
    /// Its media's time scale (units a second), from `mdhd`.
    timescale: u32,
    /// Where its edit list starts it in its media, in those units: AAC's encoder priming
    /// (1024 frames from ffmpeg's encoder, 2112 from Apple's).
    start: u64,
}

impl Track {
    /// The frames at `rate` that precede the track's edit: the encoder's priming, which ffmpeg
    /// drops (Symphonia keeps them: the audio would start 21 to 44 ms late).
    pub(super) fn priming(&self, rate: u32) -> u64 {
        if self.timescale == 0 {
            return 0;
        }
        let frames = u128::from(self.start) * u128::from(rate) / u128::from(self.timescale);
        u64::try_from(frames).unwrap_or(u64::MAX)
    }
}

/// Whether `bytes` is an ISO base media file: it opens with its `ftyp` box, as every MP4
/// writer's files do. (Symphonia's probe would find an `ftyp` anywhere in a file's first MiB;
/// here only a file that opens with one is read as MP4, and always checked first.)
pub(super) fn is_mp4(bytes: &[u8]) -> bool {
    bytes.get(4..8) == Some(b"ftyp")
}

/// Check the MP4 file `bytes` as described in the module's documentation, for a decoding of at
/// most `limit_seconds`, hiding from Symphonia what it need not read; its tracks.
pub(super) fn check(bytes: &mut [u8], limit_seconds: u64) -> Result<Vec<Track>, AudioError> {
    let mut walk = Walk {
        bytes,
        movies: 0,
        tracks: Vec::new(),
        hide: Vec::new(),
        fragments: Fragments::default(),
    };
    let file = Bx {
        kind: *b"file",
        at: 0,
        body: 0,
        end: walk.bytes.len(),
    };
    walk.children(&file, 0)?;
    walk.totals(limit_seconds)?;
    let tracks = walk.tracks.iter().map(|t| t.track).collect();
    for at in walk.hide {
        bytes[at..at + 4].copy_from_slice(b"free");
    }
    Ok(tracks)
}

/// A box: its type, where it starts, where its body (after the header) starts, and its end.
#[derive(Debug, Clone, Copy)]
struct Bx {
    kind: [u8; 4],
    at: usize,
    body: usize,
    end: usize,
}

impl Bx {
    /// The body's length.
    fn len(&self) -> usize {
        self.end - self.body
    }

    /// A refusal naming this box.
    fn refuse(&self, why: impl std::fmt::Display) -> AudioError {
        AudioError::Corrupt(format!(
            "its MP4 box `{}` at byte {} {why}",
            self.kind.escape_ascii(),
            self.at
        ))
    }

    /// A full box's version and flags, and where its fields start.
    fn full(&self, bytes: &[u8]) -> Result<(u8, u32, usize), AudioError> {
        let head = u32_at(bytes, self.body, self.end).ok_or_else(|| self.refuse("is too short for its version"))?;
        Ok(((head >> 24) as u8, head & 0x00ff_ffff, self.body + 4))
    }
}

/// The big-endian u32 at `at`, when it ends by `end`.
fn u32_at(bytes: &[u8], at: usize, end: usize) -> Option<u32> {
    let field = bytes.get(at..at.checked_add(4).filter(|&e| e <= end)?)?;
    Some(u32::from_be_bytes([field[0], field[1], field[2], field[3]]))
}

/// The big-endian u64 at `at`, when it ends by `end`.
fn u64_at(bytes: &[u8], at: usize, end: usize) -> Option<u64> {
    Some(u64::from(u32_at(bytes, at, end)?) << 32 | u64::from(u32_at(bytes, at + 4, end)?))
}

/// The header of the box at `at` inside a parent ending at `end`, read as Symphonia reads it
/// (a size of 1: a 64-bit size follows the type; 0: to the end of the file, at the top only).
fn header(bytes: &[u8], at: usize, end: usize, top: bool) -> Result<Bx, AudioError> {
    let broken = |why: String| AudioError::Corrupt(format!("its MP4 box at byte {at} {why}"));
    let size = u32_at(bytes, at, end).ok_or_else(|| broken("is cut off by the end of its parent".into()))?;
    let kind: [u8; 4] = bytes
        .get(at + 4..at + 8)
        .filter(|_| at + 8 <= end)
        .and_then(|k| k.try_into().ok())
        .ok_or_else(|| broken("is cut off by the end of its parent".into()))?;
    let (size, body) = match size {
        0 if top && matches!(&kind, b"mdat" | b"free" | b"skip") => ((end - at) as u64, at + 8),
        0 => {
            return Err(broken(format!(
                "(`{}`) has size 0 (\"to the end of the file\"), which only a top-level `mdat` may have",
                kind.escape_ascii()
            )));
        }
        1 => (
            u64_at(bytes, at + 8, end).ok_or_else(|| broken("is cut off before its 64-bit size".into()))?,
            at + 16,
        ),
        n => (u64::from(n), at + 8),
    };
    let room = (end - at) as u64;
    if size < (body - at) as u64 || size > room {
        return Err(broken(format!(
            "(`{}`) says it is {size} bytes long, but {} are its header and {room} are left in its parent",
            kind.escape_ascii(),
            body - at
        )));
    }
    Ok(Bx {
        kind,
        at,
        body,
        end: at + size as usize,
    })
}

/// The boxes from `start` to `end`, each header read by [`header`]; after an error, none. Inside
/// a box, four zero bytes or fewer at its end end it: QuickTime ends some containers so, and
/// Symphonia reads them as a box of size 0 and stops there.
fn boxes(bytes: &[u8], start: usize, end: usize, top: bool) -> impl Iterator<Item = Result<Bx, AudioError>> + '_ {
    let mut at = start;
    std::iter::from_fn(move || {
        let terminator = !top && end - at < 8 && bytes[at..end].iter().all(|&b| b == 0);
        if at >= end || terminator {
            return None;
        }
        let bx = header(bytes, at, end, top);
        at = bx.as_ref().map_or(end, |b| b.end);
        Some(bx)
    })
}

/// What a track's boxes say, as far as the totals need.
#[derive(Debug, Default)]
struct Facts {
    track: Track,
    /// Packets its time-to-sample table lists, and their duration in its time scale.
    timed: u64,
    duration: u64,
    /// Entries of its time-to-sample table: each packet's time is found walking them.
    entries: u64,
    /// Packets its sample-size table lists.
    sized: u64,
    /// Whether its edit list was read (its first edit that is not empty gives the start).
    edited: bool,
}

/// What the movie fragments (`moof`) say, over all of them.
#[derive(Debug, Default)]
struct Fragments {
    count: u64,
    /// Packets their runs list.
    packets: u64,
    /// The most runs a track fragment has: each packet's time is found walking them.
    most_runs: u64,
    /// The sum over runs of their packets squared: a run's packet times are summed from its
    /// first.
    squares: u64,
}

/// The walk through a file's boxes.
struct Walk<'a> {
    bytes: &'a [u8],
    movies: usize,
    tracks: Vec<Facts>,
    /// Where the types of boxes to hide from Symphonia are.
    hide: Vec<usize>,
    fragments: Fragments,
}

impl Walk<'_> {
    /// Walk the boxes inside `parent` from `start`.
    fn children(&mut self, parent: &Bx, start: usize) -> Result<(), AudioError> {
        let bytes = self.bytes;
        for child in boxes(bytes, start, parent.end, parent.kind == *b"file") {
            self.visit(parent, &child?)?;
        }
        Ok(())
    }

    /// Check `bx`, a child of `parent`, as far as Symphonia reads it there.
    fn visit(&mut self, parent: &Bx, bx: &Bx) -> Result<(), AudioError> {
        match (&parent.kind, &bx.kind) {
            (b"file", b"moov") => {
                // Symphonia keeps the last movie it reads: two would not be one recording.
                self.movies += 1;
                if self.movies > 1 {
                    return Err(bx.refuse("is a second movie"));
                }
                self.children(bx, bx.body)
            }
            (b"file", b"moof") => {
                self.fragments.count += 1;
                self.children(bx, bx.body)
            }
            (b"moov", b"trak") => {
                if self.tracks.len() == MAX_TRACKS {
                    return Err(bx.refuse(format!("is a track past the {MAX_TRACKS} served")));
                }
                self.tracks.push(Facts::default());
                self.children(bx, bx.body)
            }
            (b"trak", b"mdia" | b"edts") | (b"mdia", b"minf") | (b"minf", b"stbl") | (b"moov", b"mvex") => {
                self.children(bx, bx.body)
            }
            (b"moof", b"traf") => {
                let runs = self.count_children(bx, b"trun")?;
                self.fragments.most_runs = self.fragments.most_runs.max(runs);
                self.children(bx, bx.body)
            }
            (b"moov", b"udta") | (b"file", b"meta" | b"sidx") => {
                self.hide.push(bx.at + 4);
                Ok(())
            }
            (b"file", b"ftyp") if bx.len() < 8 => Err(bx.refuse("is too short for its brands")),
            (b"mdia", b"hdlr") if bx.len() < 24 => Err(bx.refuse("is too short for its handler")),
            (b"mdia", b"mdhd") => self.media_header(bx),
            (b"edts", b"elst") => self.edits(bx),
            (b"stbl", b"stsd") => self.descriptions(bx),
            (b"stbl", b"stts") => self.times(bx),
            (b"stbl", b"stsz") => self.sizes(bx),
            (b"stbl", b"stsc") => self.table(bx, 12).map(drop),
            (b"stbl", b"stco") => self.table(bx, 4).map(drop),
            (b"stbl", b"co64") => self.table(bx, 8).map(drop),
            (b"traf", b"trun") => self.run(bx),
            (b"traf", b"tfhd") => self.fragment_header(bx),
            (b"mvex", b"trex") => {
                let size = u32_at(self.bytes, bx.body + 16, bx.end).ok_or_else(|| bx.refuse("is too short"))?;
                self.packet_size(bx, size)
            }
            _ => Ok(()),
        }
    }

    /// The children of `bx` of type `kind`.
    fn count_children(&self, bx: &Bx, kind: &[u8; 4]) -> Result<u64, AudioError> {
        boxes(self.bytes, bx.body, bx.end, false)
            .try_fold(0, |count, child| Ok(count + u64::from(child?.kind == *kind)))
    }

    /// The track being read: the last `trak` begun.
    fn track(&mut self, bx: &Bx) -> Result<&mut Facts, AudioError> {
        self.tracks.last_mut().ok_or_else(|| bx.refuse("is outside a track"))
    }

    /// A full box holding a count then `count` entries of `size` bytes: the count, once the
    /// entries are known to fit in the box.
    fn table(&self, bx: &Bx, size: u64) -> Result<(u64, usize), AudioError> {
        let (_, _, at) = bx.full(self.bytes)?;
        let count = u32_at(self.bytes, at, bx.end).ok_or_else(|| bx.refuse("is too short for its count"))?;
        let room = (bx.end - at - 4) as u64;
        if u64::from(count) * size > room {
            return Err(bx.refuse(format!(
                "lists {count} entries of {size} bytes, more than its {room} bytes hold"
            )));
        }
        Ok((u64::from(count), at + 4))
    }

    /// A packet's stated size, which Symphonia reserves before reading: never past the file.
    fn packet_size(&self, bx: &Bx, size: u32) -> Result<(), AudioError> {
        if size as usize > self.bytes.len() {
            return Err(bx.refuse(format!(
                "says a packet is {size} bytes, more than the file's {}",
                self.bytes.len()
            )));
        }
        Ok(())
    }

    fn media_header(&mut self, bx: &Bx) -> Result<(), AudioError> {
        let (version, _, at) = bx.full(self.bytes)?;
        // Creation and modification times come first: 32 or 64 bits each.
        let at = at + if version == 1 { 16 } else { 8 };
        let timescale = u32_at(self.bytes, at, bx.end).ok_or_else(|| bx.refuse("is too short for its time scale"))?;
        if timescale == 0 {
            return Err(bx.refuse("says its media's time scale is 0"));
        }
        self.track(bx)?.track.timescale = timescale;
        Ok(())
    }

    fn edits(&mut self, bx: &Bx) -> Result<(), AudioError> {
        let (version, _, _) = bx.full(self.bytes)?;
        let (count, at) = self.table(bx, if version == 1 { 20 } else { 12 })?;
        let bytes = self.bytes;
        let track = self.track(bx)?;
        if track.edited {
            return Err(bx.refuse("is a track's second edit list"));
        }
        track.edited = true;
        // An edit's media time of -1 is an empty edit (a pause before the media); the first
        // other edit says where the media starts.
        let starts = (0..count as usize).map(|i| match version {
            1 => u64_at(bytes, at + i * 20 + 8, bx.end).map(|t| t as i64),
            _ => u32_at(bytes, at + i * 12 + 4, bx.end).map(|t| i64::from(t as i32)),
        });
        if let Some(start) = starts.flatten().find(|&t| t != -1) {
            track.track.start = u64::try_from(start).map_err(|_| bx.refuse(format!("starts its media at {start}")))?;
        }
        Ok(())
    }

    /// The sample descriptions: Symphonia reads the one entry's fields, then the boxes after
    /// them in an audio entry (`esds`, `dOps`, `dfLa`, `alac`, `wave` and the `esds` in it).
    fn descriptions(&mut self, bx: &Bx) -> Result<(), AudioError> {
        let (_, _, at) = bx.full(self.bytes)?;
        let entries = Bx { body: at + 4, ..*bx };
        if entries.body > bx.end {
            return Err(bx.refuse("is too short for its count"));
        }
        for entry in boxes(self.bytes, entries.body, bx.end, false) {
            let entry = entry?;
            if !matches!(
                &entry.kind,
                b"mp4a"
                    | b"alac"
                    | b"fLaC"
                    | b"Opus"
                    | b".mp3"
                    | b"lpcm"
                    | b"wave"
                    | b"alaw"
                    | b"ulaw"
                    | b"raw "
                    | b"sowt"
                    | b"twos"
                    | b"in24"
                    | b"in32"
                    | b"fl32"
                    | b"fl64"
            ) {
                continue;
            }
            // The reserved bytes and data reference (8), then the sound fields (20), and
            // QuickTime's versions 1 and 2 add 16 and 36 bytes.
            let version = self
                .bytes
                .get(entry.body + 8..entry.body + 10)
                .filter(|_| entry.body + 10 <= entry.end)
                .map(|v| u16::from_be_bytes([v[0], v[1]]))
                .ok_or_else(|| entry.refuse("is too short for its version"))?;
            let fields = match version {
                0 => 28,
                1 => 44,
                2 => 64,
                _ => continue,
            };
            if entry.len() < fields {
                return Err(entry.refuse(format!("is too short for its {fields} bytes of fields")));
            }
            for child in boxes(self.bytes, entry.body + fields, entry.end, false) {
                let child = child?;
                if child.kind == *b"wave" {
                    self.count_children(&child, b"esds")?;
                }
            }
        }
        Ok(())
    }

    fn times(&mut self, bx: &Bx) -> Result<(), AudioError> {
        let (count, at) = self.table(bx, 8)?;
        let bytes = self.bytes;
        let track = self.track(bx)?;
        track.entries += count;
        for i in 0..count as usize {
            let (n, delta) = (
                u32_at(bytes, at + i * 8, bx.end).unwrap_or(0),
                u32_at(bytes, at + i * 8 + 4, bx.end).unwrap_or(0),
            );
            track.timed += u64::from(n);
            track.duration = track.duration.saturating_add(u64::from(n) * u64::from(delta));
        }
        Ok(())
    }

    fn sizes(&mut self, bx: &Bx) -> Result<(), AudioError> {
        let (_, _, at) = bx.full(self.bytes)?;
        let (size, count) = match (u32_at(self.bytes, at, bx.end), u32_at(self.bytes, at + 4, bx.end)) {
            (Some(size), Some(count)) => (size, count),
            _ => return Err(bx.refuse("is too short for its count")),
        };
        if size == 0 {
            // Each packet's size follows the count.
            let room = bx.end.saturating_sub(at + 8) as u64;
            if u64::from(count) * 4 > room {
                return Err(bx.refuse(format!(
                    "lists {count} packet sizes of 4 bytes, more than its {room} bytes hold"
                )));
            }
            for i in 0..count as usize {
                self.packet_size(bx, u32_at(self.bytes, at + 8 + i * 4, bx.end).unwrap_or(0))?;
            }
        } else {
            self.packet_size(bx, size)?;
        }
        self.track(bx)?.sized += u64::from(count);
        Ok(())
    }

    fn fragment_header(&mut self, bx: &Bx) -> Result<(), AudioError> {
        let (_, flags, at) = bx.full(self.bytes)?;
        // The track id, then the optional fields its flags name, in this order.
        let mut at = at + 4;
        for (flag, bytes) in [(0x01, 8), (0x02, 4), (0x08, 4)] {
            at += if flags & flag != 0 { bytes } else { 0 };
        }
        if flags & 0x10 != 0 {
            let size = u32_at(self.bytes, at, bx.end).ok_or_else(|| bx.refuse("is too short for its fields"))?;
            self.packet_size(bx, size)?;
        }
        Ok(())
    }

    fn run(&mut self, bx: &Bx) -> Result<(), AudioError> {
        let (_, flags, at) = bx.full(self.bytes)?;
        let count = u32_at(self.bytes, at, bx.end).ok_or_else(|| bx.refuse("is too short for its count"))?;
        // A data offset and the first packet's flags, when its flags say they are there.
        let first = at + 4 + 4 * ((flags & 0x01 != 0) as usize + (flags & 0x04 != 0) as usize);
        // Each packet's duration, size, flags and time offset, each 4 bytes when present.
        let each = 4 * (flags & 0xf00).count_ones() as u64;
        let room = bx.end.saturating_sub(first) as u64;
        if first > bx.end || u64::from(count) * each > room {
            return Err(bx.refuse(format!(
                "lists {count} packets of {each} bytes, more than its {room} bytes hold"
            )));
        }
        if flags & 0x200 != 0 {
            // The size follows the duration when both are there.
            let offset = if flags & 0x100 != 0 { 4 } else { 0 };
            for i in 0..count as usize {
                let size = u32_at(self.bytes, first + i * each as usize + offset, bx.end).unwrap_or(0);
                self.packet_size(bx, size)?;
            }
        }
        let count = u64::from(count);
        self.fragments.packets += count;
        self.fragments.squares = self.fragments.squares.saturating_add(count * count);
        Ok(())
    }

    /// The file as a whole: how long its tracks last, how many packets they list, and what
    /// reading them costs.
    fn totals(&self, limit_seconds: u64) -> Result<(), AudioError> {
        if self.movies == 0 || self.tracks.is_empty() {
            return Err(AudioError::Corrupt("its MP4 movie (`moov`) has no track".into()));
        }
        let mut packets = self.fragments.packets;
        let mut entries = 0u64;
        for track in &self.tracks {
            if track.track.timescale == 0 {
                return Err(AudioError::Corrupt(
                    "one of its MP4 tracks has no media header (`mdhd`)".into(),
                ));
            }
            if track.duration / u64::from(track.track.timescale) > limit_seconds {
                return Err(AudioError::TooLong { limit_seconds });
            }
            packets = packets.saturating_add(track.timed.max(track.sized));
            entries += track.entries;
        }
        let most = limit_seconds.saturating_mul(PACKETS_PER_SECOND);
        if packets > most {
            return Err(AudioError::Corrupt(format!(
                "its MP4 tables list {packets} packets, more than {limit_seconds} s of audio holds ({most})"
            )));
        }
        // Each packet, Symphonia finds every track's next time: in its time-to-sample table,
        // or in its fragment's runs; once a track has ended, past every later fragment.
        let tracks = self.tracks.len() as u64;
        let stragglers = if tracks > 1 { self.fragments.count } else { 0 };
        let per_packet = tracks + entries + self.fragments.most_runs + stragglers;
        let work = packets
            .saturating_mul(per_packet)
            .saturating_add(self.fragments.squares);
        if work > WORK {
            return Err(AudioError::Corrupt(format!(
                "its MP4 tables ({packets} packets, {entries} time entries, {} fragments) would take \
                 {work} steps to read, more than the {WORK} served",
                self.fragments.count
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
