//! Images for a vision tower (CLIP's, SigLIP's): the preprocessing its folder's
//! `preprocessor_config.json` names, as `transformers`' `CLIPImageProcessor` and
//! `SiglipImageProcessor` do it (convert to RGB, resize with Pillow's filter, center crop,
//! rescale, normalize), and the decoding of a client's file (PNG, JPEG, WebP) within limits
//! that a hostile file cannot pass (a decompression bomb is refused from its header).

mod resample;

use std::io::Cursor;
use std::path::Path;

use serde_json::Value;

pub use resample::{Filter, Rgb, resize};

use super::folder::json;

/// The most bytes an image file may have (after its base64 is decoded).
pub const MAX_IMAGE_BYTES: usize = 20 << 20;
/// The most pixels an image may have (width times height): 40 megapixels, e.g. 8000 x 5000.
pub const MAX_IMAGE_PIXELS: u64 = 40_000_000;
/// The longest side an image may have.
pub const MAX_IMAGE_SIDE: u32 = 16_384;

/// How an image is resized before its crop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resize {
    /// Its shorter side to this, its longer in proportion (CLIP's `size.shortest_edge`).
    ShortestEdge(usize),
    /// To exactly this height and width (SigLIP's `size.height`, `size.width`).
    Exact(usize, usize),
}

/// What a `preprocessor_config.json` says to do to an image.
#[derive(Debug, Clone, PartialEq)]
pub struct Preprocessor {
    /// `do_resize`, `size`, `resample`.
    pub resize: Option<(Resize, Filter)>,
    /// `do_center_crop`, `crop_size`: height and width.
    pub crop: Option<(usize, usize)>,
    /// `do_rescale`, `rescale_factor`.
    pub rescale: Option<f64>,
    /// `do_normalize`, `image_mean`, `image_std`.
    pub normalize: Option<([f32; 3], [f32; 3])>,
}

/// The image processors whose steps are these (and their fast variants, which take the same
/// file; they resize with torchvision rather than Pillow, and the slow one is the reference).
const PROCESSORS: [&str; 5] = [
    "CLIPImageProcessor",
    "CLIPImageProcessorFast",
    "CLIPFeatureExtractor",
    "SiglipImageProcessor",
    "SiglipImageProcessorFast",
];

/// The file a vision tower's folder describes its preprocessing in.
pub const PREPROCESSOR_CONFIG: &str = "preprocessor_config.json";

impl Preprocessor {
    /// The preprocessing `folder`'s `preprocessor_config.json` names, or `None` without one;
    /// an error names the file and the key.
    pub fn read(folder: &Path) -> Result<Option<Preprocessor>, String> {
        let Some(config) = json(folder, PREPROCESSOR_CONFIG)? else {
            return Ok(None);
        };
        let file = folder.join(PREPROCESSOR_CONFIG).display().to_string();
        Preprocessor::from_config(&config)
            .map(Some)
            .map_err(|e| format!("{file}: {e}"))
    }

    /// The preprocessing of a `preprocessor_config.json`'s JSON; an error names the key.
    fn from_config(config: &Value) -> Result<Preprocessor, String> {
        let kind = config["image_processor_type"]
            .as_str()
            .or(config["feature_extractor_type"].as_str());
        if let Some(kind) = kind.filter(|k| !PROCESSORS.contains(k)) {
            return Err(format!(
                "`image_processor_type` is `{kind}`; served: {}",
                PROCESSORS.join(", ")
            ));
        }
        // transformers' defaults for a key the file leaves out are the processor's own: on for
        // each step, 1/255, Pillow's bicubic (CLIP's; SigLIP's files name theirs); SigLIP's
        // processor has no crop.
        let siglip = kind.is_some_and(|k| k.starts_with("Siglip"));
        let on = |key: &str| match &config[key] {
            Value::Null => Ok(key != "do_center_crop" || !siglip),
            v => v.as_bool().ok_or_else(|| format!("`{key}` is {v}, not true or false")),
        };
        if !on("do_convert_rgb")? {
            return Err("`do_convert_rgb` is false: the vision tower is given RGB images only".into());
        }
        let resize = match on("do_resize")? {
            true => {
                let filter = match &config["resample"] {
                    Value::Null => Filter::Bicubic,
                    v => v.as_u64().and_then(Filter::from_pillow).ok_or_else(|| {
                        format!("`resample` is {v}; served: Pillow's 1 (Lanczos), 2 (bilinear), 3 (bicubic), 4 (box), 5 (Hamming)")
                    })?,
                };
                Some((size(&config["size"])?, filter))
            }
            false => None,
        };
        let crop = match on("do_center_crop")? {
            true => Some(match &config["crop_size"] {
                Value::Null => return Err("`do_center_crop` is true but `crop_size` is missing".into()),
                v => match size_of(v, "crop_size")? {
                    Resize::ShortestEdge(n) => (n, n),
                    Resize::Exact(h, w) => (h, w),
                },
            }),
            false => None,
        };
        let rescale = match on("do_rescale")? {
            true => Some(match &config["rescale_factor"] {
                Value::Null => 1.0 / 255.0,
                v => v
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0)
                    .ok_or_else(|| format!("`rescale_factor` is {v}, not a number above 0"))?,
            }),
            false => None,
        };
        let normalize = match on("do_normalize")? {
            true => Some((three(config, "image_mean", false)?, three(config, "image_std", true)?)),
            false => None,
        };
        let read = Preprocessor {
            resize,
            crop,
            rescale,
            normalize,
        };
        read.size()?;
        Ok(read)
    }

    /// The height and width of every image it gives (the crop's, else the resize's): the
    /// vision tower takes one size, so a resize to the shortest edge needs a crop, and a crop
    /// larger than the resized image (which transformers pads with black) is refused.
    pub fn size(&self) -> Result<(usize, usize), String> {
        match (self.resize, self.crop) {
            (Some((Resize::Exact(h, w), _)), None) => Ok((h, w)),
            (Some((Resize::Exact(h, w), _)), Some((ch, cw))) if ch <= h && cw <= w => Ok((ch, cw)),
            (Some((Resize::ShortestEdge(n), _)), Some((ch, cw))) if ch <= n && cw <= n => Ok((ch, cw)),
            (Some(_), Some(_)) => Err("`crop_size` is larger than `size`: the crop would be padded".into()),
            (Some((Resize::ShortestEdge(_), _)), None) | (None, _) => Err(
                "images of different sizes would stay different (no `size.height`/`size.width` resize nor a `crop_size` crop): the vision tower takes one size".into(),
            ),
        }
    }

    /// `image` as the vision tower's `pixel_values` of one image: channels, then rows, then
    /// columns (`[3, height, width]`), each step as transformers takes it.
    pub fn pixels(&self, image: &Rgb) -> Vec<f32> {
        let resized = match self.resize {
            Some((Resize::Exact(h, w), filter)) => resize(image, w, h, filter),
            Some((Resize::ShortestEdge(n), filter)) => {
                let (w, h) = shortest_edge(image.width, image.height, n);
                resize(image, w, h, filter)
            }
            None => image.clone(),
        };
        let (height, width) = self.size().expect("checked by read");
        // transformers' `center_crop`: the top-left corner rounded down.
        let top = (resized.height - height) / 2;
        let left = (resized.width - width) / 2;
        let mut out = vec![0f32; 3 * height * width];
        for y in 0..height {
            for x in 0..width {
                for c in 0..3 {
                    let level = resized.data[((top + y) * resized.width + left + x) * 3 + c];
                    // Rescaled in f64 then kept as f32, normalized in f32: transformers' order.
                    let mut v = match self.rescale {
                        Some(factor) => (f64::from(level) * factor) as f32,
                        None => f32::from(level),
                    };
                    if let Some((mean, std)) = &self.normalize {
                        v = (v - mean[c]) / std[c];
                    }
                    out[(c * height + y) * width + x] = v;
                }
            }
        }
        out
    }
}

/// The width and height of an image `width` x `height` whose shorter side becomes `edge`, its
/// longer cut down to a whole pixel (transformers' `get_resize_output_image_size`).
fn shortest_edge(width: usize, height: usize, edge: usize) -> (usize, usize) {
    let (short, long) = (width.min(height), width.max(height));
    let long = ((edge * long) as f64 / short as f64) as usize;
    match width <= height {
        true => (edge, long),
        false => (long, edge),
    }
}

/// `size`: `{"shortest_edge": n}`, `{"height": h, "width": w}`, or a number (CLIP's old files:
/// the shortest edge).
fn size(v: &Value) -> Result<Resize, String> {
    match v {
        Value::Null => Err("`do_resize` is true but `size` is missing".into()),
        v => size_of(v, "size"),
    }
}

/// A size under `key`, every number a positive whole one.
fn size_of(v: &Value, key: &str) -> Result<Resize, String> {
    let n = |v: &Value, at: &str| {
        v.as_u64()
            .filter(|n| *n > 0 && *n <= u64::from(MAX_IMAGE_SIDE))
            .map(|n| n as usize)
            .ok_or_else(|| format!("`{at}` is {v}, not a number of pixels"))
    };
    match v {
        Value::Number(_) => Ok(Resize::ShortestEdge(n(v, key)?)),
        Value::Object(o) if o.contains_key("shortest_edge") => Ok(Resize::ShortestEdge(n(
            &o["shortest_edge"],
            &format!("{key}.shortest_edge"),
        )?)),
        Value::Object(o) if o.contains_key("height") => Ok(Resize::Exact(
            n(&o["height"], &format!("{key}.height"))?,
            n(&v["width"], &format!("{key}.width"))?,
        )),
        other => Err(format!(
            "`{key}` is {other}; it is {{\"shortest_edge\": n}}, {{\"height\": h, \"width\": w}} or a number"
        )),
    }
}

/// Three numbers under `key` (one per channel); `above_zero` for a divisor.
fn three(config: &Value, key: &str, above_zero: bool) -> Result<[f32; 3], String> {
    let bad = || {
        format!(
            "`{key}` is {}, not three numbers{}",
            config[key],
            if above_zero { " above 0" } else { "" }
        )
    };
    let values = config[key].as_array().filter(|a| a.len() == 3).ok_or_else(bad)?;
    let mut out = [0f32; 3];
    for (o, v) in out.iter_mut().zip(values) {
        *o = v
            .as_f64()
            .filter(|x| x.is_finite() && (!above_zero || *x > 0.0))
            .ok_or_else(bad)? as f32;
    }
    Ok(out)
}

/// Why a client's image cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// More bytes than [`MAX_IMAGE_BYTES`].
    #[error("the image is {0} bytes, above the limit of {MAX_IMAGE_BYTES}")]
    TooManyBytes(usize),
    /// Not a PNG, JPEG or WebP file.
    #[error("the image is not PNG, JPEG or WebP{0}")]
    Unsupported(String),
    /// Its header says more pixels than the limits.
    #[error("the image is {0} x {1} pixels, above the limit of {MAX_IMAGE_PIXELS} pixels and {MAX_IMAGE_SIDE} a side")]
    TooLarge(u32, u32),
    /// The file is damaged or cut short.
    #[error("the {0} image cannot be decoded: {1}")]
    Undecodable(&'static str, String),
}

/// The RGB pixels of a client's PNG, JPEG or WebP file, within the limits: its header is read
/// first, so a file that claims too many pixels is refused before anything is allocated for
/// them; an alpha channel is dropped and gray is repeated in each channel (Pillow's
/// `convert("RGB")`, which transformers applies). EXIF orientation is not applied, as neither
/// Pillow's `open` nor the processor applies it.
pub fn decode(bytes: &[u8]) -> Result<Rgb, ImageError> {
    use image::{ImageFormat, ImageReader, Limits};
    if bytes.len() > MAX_IMAGE_BYTES {
        return Err(ImageError::TooManyBytes(bytes.len()));
    }
    let reader = || {
        ImageReader::new(Cursor::new(bytes))
            .with_guessed_format()
            .expect("reading from memory cannot fail")
    };
    let format = match reader().format() {
        Some(f @ (ImageFormat::Png | ImageFormat::Jpeg | ImageFormat::WebP)) => f,
        Some(other) => return Err(ImageError::Unsupported(format!(" (it is {other:?})"))),
        None => return Err(ImageError::Unsupported(String::new())),
    };
    let name = match format {
        ImageFormat::Png => "PNG",
        ImageFormat::Jpeg => "JPEG",
        _ => "WebP",
    };
    let undecodable = |e: image::ImageError| ImageError::Undecodable(name, e.to_string());
    let (width, height) = reader().into_dimensions().map_err(undecodable)?;
    if u64::from(width) * u64::from(height) > MAX_IMAGE_PIXELS || width.max(height) > MAX_IMAGE_SIDE {
        return Err(ImageError::TooLarge(width, height));
    }
    let mut limits = Limits::default();
    limits.max_image_width = Some(MAX_IMAGE_SIDE);
    limits.max_image_height = Some(MAX_IMAGE_SIDE);
    // The decoded image at 16 bits and 4 channels, the most a PNG decodes to, and its RGB copy.
    limits.max_alloc = Some(MAX_IMAGE_PIXELS * 11);
    let mut reader = reader();
    reader.limits(limits);
    let decoded = reader.decode().map_err(undecodable)?;
    let rgb = decoded.into_rgb8();
    Ok(Rgb {
        width: rgb.width() as usize,
        height: rgb.height() as usize,
        data: rgb.into_raw(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn clip_config() -> Value {
        serde_json::json!({
            "crop_size": {"height": 4, "width": 4}, "do_center_crop": true, "do_normalize": true,
            "do_rescale": true, "do_resize": true, "image_mean": [0.5, 0.25, 0.0],
            "image_processor_type": "CLIPImageProcessor", "image_std": [0.5, 0.5, 1.0],
            "resample": 3, "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 4}
        })
    }

    #[test]
    fn clip_s_and_siglip_s_files_are_read_and_bad_keys_named() {
        let clip = Preprocessor::from_config(&clip_config()).unwrap();
        assert_eq!(clip.resize, Some((Resize::ShortestEdge(4), Filter::Bicubic)));
        assert_eq!(clip.size(), Ok((4, 4)));
        let siglip = serde_json::json!({"image_processor_type": "SiglipImageProcessor", "resample": 2,
            "size": {"height": 6, "width": 5}, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]});
        let siglip = Preprocessor::from_config(&siglip).unwrap();
        assert_eq!(
            (siglip.resize, siglip.crop, siglip.size()),
            (Some((Resize::Exact(6, 5), Filter::Bilinear)), None, Ok((6, 5)))
        );
        let with = |key: &str, v: Value| {
            let mut c = clip_config();
            c[key] = v;
            Preprocessor::from_config(&c).unwrap_err()
        };
        assert!(with("resample", 0.into()).starts_with("`resample` is 0; served"));
        assert_eq!(
            with("image_std", serde_json::json!([1, 0, 1])),
            "`image_std` is [1,0,1], not three numbers above 0"
        );
        assert!(
            with("image_processor_type", "ViTImageProcessor".into())
                .starts_with("`image_processor_type` is `ViTImageProcessor`")
        );
        assert!(with("crop_size", serde_json::json!({"height": 9, "width": 9})).contains("larger than `size`"));
        assert!(with("do_center_crop", false.into()).contains("the vision tower takes one size"));
        assert_eq!(
            with("size", serde_json::json!({"shortest_edge": 0})),
            "`size.shortest_edge` is 0, not a number of pixels"
        );
    }

    #[test]
    fn the_shorter_side_is_resized_the_centre_cropped_then_rescaled_and_normalized_per_channel() {
        assert_eq!(shortest_edge(97, 40, 32), (77, 32));
        assert_eq!(shortest_edge(36, 70, 32), (32, 62));
        let clip = Preprocessor::from_config(&clip_config()).unwrap();
        // A 4 x 8 image (already 4 on its short side, so not resampled): the crop keeps rows 2..6.
        let mut data = Vec::new();
        for y in 0..8u8 {
            for _ in 0..4 {
                data.extend([y * 30, 255, 51]);
            }
        }
        let pixels = clip.pixels(&Rgb {
            width: 4,
            height: 8,
            data,
        });
        assert_eq!(pixels.len(), 3 * 16);
        let red_row2 = (60.0 / 255.0 - 0.5) / 0.5;
        assert!((pixels[0] - red_row2).abs() < 1e-6);
        assert!((pixels[16] - 1.5).abs() < 1e-6, "green: (1 - 0.25) / 0.5");
        assert!((pixels[32] - 0.2).abs() < 1e-6, "blue: 51/255");
    }

    /// The largest and the mean difference between the pixel values made here and
    /// transformers' (`CLIPImageProcessor`'s in models/embed/clip/reference.json,
    /// `SiglipImageProcessor`'s in models/embed/siglip/), for each fixture image (in clip/images).
    fn differences_from_transformers(fixture: &str) -> Vec<(String, f32, f32)> {
        let embed = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/models/embed"));
        let (folder, files) = (embed.join(fixture), embed.join("clip/images"));
        let processor = Preprocessor::read(&folder).unwrap().unwrap();
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(folder.join("reference.json")).unwrap()).unwrap();
        let images = reference["images"].as_array().unwrap();
        images
            .iter()
            .map(|image| {
                let file = image["file"].as_str().unwrap();
                let bytes = std::fs::read(files.join(file)).unwrap();
                let pixels = processor.pixels(&decode(&bytes).unwrap());
                let expected = image["pixel_values"].as_array().unwrap();
                assert_eq!(pixels.len(), expected.len());
                let differences: Vec<f32> = pixels
                    .iter()
                    .zip(expected)
                    .map(|(a, b)| (a - b.as_f64().unwrap() as f32).abs())
                    .collect();
                let most = differences.iter().copied().fold(0f32, f32::max);
                let mean = differences.iter().sum::<f32>() / differences.len() as f32;
                (file.to_string(), most, mean)
            })
            .collect()
    }

    #[test]
    fn pixels_equal_transformers_processors_for_png_and_webp_and_nearly_for_jpeg() {
        let both = [
            ("clip", differences_from_transformers("clip")),
            ("siglip", differences_from_transformers("siglip")),
        ];
        for (file, most, mean) in both
            .into_iter()
            .flat_map(|(fixture, d)| d.into_iter().map(move |(f, m, a)| (format!("{fixture}: {f}"), m, a)))
        {
            println!("{file}: pixel_values differ by {most:e} at most, {mean:e} on average");
            // A PNG's and a lossless WebP's pixels are Pillow's to the bit (the reference is
            // rounded to 1e-6). A JPEG's
            // are decoded by zune-jpeg here and libjpeg-turbo in Pillow, whose IDCTs and chroma
            // upsampling round differently; a level is 1/255/std (about 0.0146 for CLIP's std).
            // Measured on these noisy test images: 0.22 at most (at sharp edges of the noise),
            // 0.0074 on average (half a level).
            let (most_bound, mean_bound) = if !file.ends_with(".jpg") {
                (2e-6, 1e-6)
            } else {
                (0.3, 0.015)
            };
            assert!(most <= most_bound && mean <= mean_bound, "{file}: {most}, {mean}");
        }
    }

    #[test]
    fn hostile_or_unsupported_files_are_refused_naming_what_is_wrong() {
        assert_eq!(
            decode(b"GIF89a......"),
            Err(ImageError::Unsupported(" (it is Gif)".into()))
        );
        assert_eq!(decode(b"hello"), Err(ImageError::Unsupported(String::new())));
        // A PNG whose header claims 100000 x 100000 pixels: refused before any pixel is read.
        let bomb = crate::testing::png_bomb(100_000, 100_000);
        assert_eq!(decode(&bomb), Err(ImageError::TooLarge(100_000, 100_000)));
        let cut = &include_bytes!("../../../models/embed/clip/images/square.png")[..200];
        assert!(matches!(decode(cut), Err(ImageError::Undecodable("PNG", _))));
        assert_eq!(
            decode(&vec![0; MAX_IMAGE_BYTES + 1]),
            Err(ImageError::TooManyBytes(MAX_IMAGE_BYTES + 1))
        );
    }
}
