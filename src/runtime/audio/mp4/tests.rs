//! Forged MP4 files made from `models/speech/audio/gpu.m4a` (ffmpeg's AAC in M4A: `ftyp`,
//! `free`, `mdat`, then `moov`, one track, one chunk), each refused naming what is wrong before
//! Symphonia reads it, and the good ones decoded.

use super::*;
use crate::runtime::audio::decode;

const STBL: [&[u8; 4]; 5] = [b"moov", b"trak", b"mdia", b"minf", b"stbl"];

fn clip() -> Vec<u8> {
    std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/models/speech/audio/gpu.m4a")).unwrap()
}

fn u32_of(file: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(file[at..at + 4].try_into().unwrap())
}

/// Where each box on `path` from the top of `file` starts.
fn find(file: &[u8], path: &[&[u8; 4]]) -> Vec<usize> {
    let (mut at, mut end, mut found) = (0, file.len(), Vec::new());
    for kind in path {
        loop {
            assert!(at + 8 <= end, "no `{}` in the clip", kind.escape_ascii());
            let size = u32_of(file, at) as usize;
            if &file[at + 4..at + 8] == *kind {
                found.push(at);
                (end, at) = (at + size, at + 8);
                break;
            }
            at += size;
        }
    }
    found
}

/// `file` with the box at the end of `path` replaced by `with` (a whole box, or nothing), its
/// parents' sizes changed to fit. Every box the clip's `moov` holds is after its media data, so
/// no chunk moves.
fn replace(file: &[u8], path: &[&[u8; 4]], with: &[u8]) -> Vec<u8> {
    let found = find(file, path);
    let at = *found.last().unwrap();
    let old = u32_of(file, at) as usize;
    let mut out = [&file[..at], with, &file[at + old..]].concat();
    for &parent in &found[..found.len() - 1] {
        let size = u32_of(&out, parent) as usize + with.len() - old;
        out[parent..parent + 4].copy_from_slice(&(size as u32).to_be_bytes());
    }
    out
}

/// A full box of `kind` (version 0, no flags) holding `fields`.
fn full(kind: &[u8; 4], fields: &[u32]) -> Vec<u8> {
    let mut out = ((12 + 4 * fields.len()) as u32).to_be_bytes().to_vec();
    out.extend_from_slice(kind);
    out.extend_from_slice(&[0; 4]);
    out.extend(fields.iter().flat_map(|f| f.to_be_bytes()));
    out
}

/// `path` under the sample table.
fn table(kind: &'static [u8; 4]) -> Vec<&'static [u8; 4]> {
    let mut path = STBL.to_vec();
    path.push(kind);
    path
}

/// `file` with every chunk offset moved by `by` bytes (its media data moved).
fn chunks_moved(mut file: Vec<u8>, by: i64) -> Vec<u8> {
    let stco = *find(&file, &table(b"stco")).last().unwrap();
    for i in 0..u32_of(&file, stco + 12) as usize {
        let at = stco + 16 + 4 * i;
        let offset = (i64::from(u32_of(&file, at)) + by) as u32;
        file[at..at + 4].copy_from_slice(&offset.to_be_bytes());
    }
    file
}

/// The refusal of `file`, which must be the decoder's "could not be decoded" naming `names`.
fn refused(file: Vec<u8>, names: &str) -> String {
    let why = decode(file, 16_000, 7200).expect_err(names).to_string();
    assert!(
        why.starts_with("the audio could not be decoded: its MP4") && why.contains(names),
        "{why}"
    );
    why
}

#[test]
fn the_clip_passes_its_priming_is_its_edit_lists_and_its_tags_are_hidden() {
    let mut file = clip();
    assert!(is_mp4(&file));
    let tracks = check(&mut file, 7200).unwrap();
    // ffmpeg's encoder: 1024 frames of priming at 44.1 kHz, its media's time scale.
    assert_eq!(
        tracks,
        [Track {
            timescale: 44_100,
            start: 1024
        }]
    );
    assert_eq!(tracks[0].priming(44_100), 1024);
    assert_eq!(tracks[0].priming(16_000), 371);
    assert_eq!(find(&clip(), &[b"moov", b"udta"]).len(), 2);
    assert!(
        !file.windows(4).any(|w| w == b"udta"),
        "Symphonia does not see the tags"
    );
    // Decoded: 160 packets of 1024 frames and a last of 728 padded to 1024, less the priming,
    // as ffmpeg gives them (`models/speech/reference.json`), at 16 kHz rounded up.
    assert_eq!(decode(clip(), 16_000, 60).unwrap().len(), 59_444);
}

#[test]
fn a_table_whose_entries_cannot_fit_its_box_is_refused_naming_it() {
    // Each would have Symphonia reserve gigabytes (16 to 64 GiB for 2^32-1 entries) before it
    // read one: an abort, not a panic.
    let cases: [(&[u8; 4], Vec<u32>, &str); 7] = [
        (b"stsz", vec![0, u32::MAX], "lists 4294967295 packet sizes of 4 bytes"),
        (b"stco", vec![1 << 30], "lists 1073741824 entries of 4 bytes"),
        (b"co64", vec![u32::MAX], "lists 4294967295 entries of 8 bytes"),
        (b"stsc", vec![u32::MAX], "lists 4294967295 entries of 12 bytes"),
        (b"stts", vec![u32::MAX], "lists 4294967295 entries of 8 bytes"),
        (b"elst", vec![u32::MAX], "lists 4294967295 entries of 12 bytes"),
        (b"trun", vec![u32::MAX], "outside"),
    ];
    for (kind, fields, says) in cases {
        let forged = full(kind, &fields);
        let file = match kind {
            b"co64" => replace(&clip(), &table(b"stco"), &forged),
            b"elst" => replace(&clip(), &[b"moov", b"trak", b"edts", b"elst"], &forged),
            // A run outside a fragment is not read: the clip decodes as it is.
            b"trun" => {
                let file = replace(&clip(), &table(b"sgpd"), &forged);
                assert_eq!(decode(file, 16_000, 60).unwrap().len(), 59_444);
                continue;
            }
            _ => replace(&clip(), &table(kind), &forged),
        };
        let why = refused(file, &format!("`{}`", kind.escape_ascii()));
        assert!(why.contains(says), "{why}");
    }
}

#[test]
fn tables_listing_more_than_the_limit_holds_are_refused() {
    // Billions of packets of 1024 frames: 27 hours at 44.1 kHz.
    let long = replace(&clip(), &table(b"stts"), &full(b"stts", &[1, u32::MAX, 1024]));
    assert_eq!(
        decode(long, 16_000, 7200).unwrap_err(),
        AudioError::TooLong { limit_seconds: 7200 }
    );
    // Billions of packets that take no time, or of one byte each.
    let timeless = replace(&clip(), &table(b"stts"), &full(b"stts", &[1, u32::MAX, 0]));
    refused(
        timeless,
        "tables list 4294967295 packets, more than 7200 s of audio holds (2880000)",
    );
    let bytes = replace(&clip(), &table(b"stsz"), &full(b"stsz", &[1, u32::MAX]));
    refused(bytes, "tables list 4294967295 packets");
    // A packet as large as the file's largest could be, which Symphonia would reserve.
    let large = replace(&clip(), &table(b"stsz"), &full(b"stsz", &[u32::MAX, 161]));
    refused(large, "says a packet is 4294967295 bytes, more than the file's");
    let entry = replace(&clip(), &table(b"stsz"), &full(b"stsz", &[0, 1, u32::MAX]));
    refused(entry, "says a packet is 4294967295 bytes");
}

#[test]
fn a_time_table_of_one_entry_a_packet_is_refused_past_what_its_walks_cost() {
    // Symphonia finds each packet's time from the table's first entry: 50,000 entries of one
    // packet each are 2.5 billion steps. 40,000 are 1.6 billion: served.
    for (entries, served) in [(50_000u32, false), (40_000, true)] {
        let mut fields = vec![entries];
        fields.extend((0..entries).flat_map(|_| [1, 1024]));
        let file = replace(&clip(), &table(b"stts"), &full(b"stts", &fields));
        let mut bytes = file.clone();
        let checked = check(&mut bytes, 7200);
        assert_eq!(checked.is_ok(), served, "{entries}: {checked:?}");
        if !served {
            refused(file, "would take 2500050000 steps to read");
        }
    }
}

#[test]
fn box_sizes_past_their_parent_zero_one_or_under_a_header_are_refused() {
    let moov = find(&clip(), &[b"moov"])[0];
    let stsz = *find(&clip(), &table(b"stsz")).last().unwrap();
    let sized = |at: usize, size: u32| {
        let mut file = clip();
        file[at..at + 4].copy_from_slice(&size.to_be_bytes());
        file
    };
    refused(sized(moov, u32::MAX), "says it is 4294967295 bytes long");
    refused(sized(stsz, 0x10000), "says it is 65536 bytes long");
    // 0 ("to the end") only for media data at the top; 1: a 64-bit size follows, here 0.
    refused(sized(stsz, 0), "(`stsz`) has size 0");
    refused(sized(moov, 0), "(`moov`) has size 0");
    refused(sized(stsz, 1), "says it is 0 bytes long, but 16 are its header");
    refused(sized(stsz, 7), "says it is 7 bytes long, but 8 are its header");
    // A 64-bit size past the file.
    let mut large = sized(stsz, 1);
    large[stsz + 8..stsz + 16].copy_from_slice(&u64::MAX.to_be_bytes());
    refused(large, "says it is 18446744073709551615 bytes long");
}

#[test]
fn sizes_of_one_and_zero_where_they_are_good_are_read() {
    // The clip's 8-byte `free` written with a 64-bit size: 16 bytes, the media 8 bytes later.
    let mut file = chunks_moved(clip(), 8);
    let free = find(&file, &[b"free"])[0];
    let wide = [&1u32.to_be_bytes()[..], b"free", &16u64.to_be_bytes()].concat();
    file.splice(free..free + 8, wide);
    assert_eq!(decode(file, 16_000, 60).unwrap().len(), 59_444);
    // The movie first and the media data last, its size 0: to the end of the file.
    let clip = clip();
    let (free, mdat, moov) = (
        find(&clip, &[b"free"])[0],
        find(&clip, &[b"mdat"])[0],
        find(&clip, &[b"moov"])[0],
    );
    let mut file = [
        &clip[..free],
        &clip[moov..],
        &[0, 0, 0, 0],
        b"mdat",
        &clip[mdat + 8..moov],
    ]
    .concat();
    // The media data began at `mdat + 8`; it begins after the movie and a header now.
    file = chunks_moved(file, (free + clip.len() - moov) as i64 - mdat as i64);
    let samples = decode(file, 16_000, 60).unwrap();
    assert_eq!(samples, decode(clip, 16_000, 60).unwrap());
}

#[test]
fn a_movie_nested_deep_or_with_too_many_tracks_is_refused() {
    // 100,000 movies one in another: Symphonia reads none of them, and neither does the check.
    let clip = clip();
    let (ftyp, depth) = (&clip[..find(&clip, &[b"free"])[0]], 100_000usize);
    let mut file = ftyp.to_vec();
    for level in 0..depth {
        file.extend_from_slice(&(((depth - level) * 8) as u32).to_be_bytes());
        file.extend_from_slice(b"moov");
    }
    refused(file, "movie (`moov`) has no track");
    // 65 tracks.
    let trak = find(&clip, &[b"moov", b"trak"]);
    let one = &clip[trak[1]..trak[1] + u32_of(&clip, trak[1]) as usize];
    let many = replace(&clip, &[b"moov", b"trak"], &one.repeat(65));
    refused(many, "is a track past the 64 served");
}

#[test]
fn a_fragment_run_too_long_for_its_box_or_listing_too_much_is_refused() {
    // `gpu.mp4`: fragmented as Safari records, a `moof` a second, each run listing its packets'
    // sizes (flags 0x201: a data offset, then 4 bytes a packet).
    let mp4 = || std::fs::read(concat!(env!("CARGO_MANIFEST_DIR"), "/models/speech/audio/gpu.mp4")).unwrap();
    assert_eq!(decode(mp4(), 16_000, 60).unwrap().len(), 59_734);
    let trun = mp4().windows(4).position(|w| w == b"trun").unwrap() - 4;
    let trex = mp4().windows(4).position(|w| w == b"trex").unwrap() - 4;
    let set = |at: usize, value: u32| {
        let mut file = mp4();
        file[at..at + 4].copy_from_slice(&value.to_be_bytes());
        file
    };
    refused(set(trun + 12, u32::MAX), "`trun`");
    // No per-packet fields: billions of packets fit in no bytes, and are too many.
    let mut empty = set(trun + 12, u32::MAX);
    empty[trun + 8..trun + 12].copy_from_slice(&1u32.to_be_bytes());
    refused(empty, "tables list 4294967423 packets");
    refused(set(trex + 24, u32::MAX), "`trex` at byte");
}
